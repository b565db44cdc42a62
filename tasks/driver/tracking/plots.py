"""The run's plots: train and held-out reward against step, saved beside the run and logged."""

from __future__ import annotations

from pathlib import Path

from rlstages.configs import RunConfig
from rlstages.tasks.driver.tracking.runs import log_file, metric_history


def log_reward_curve(cfg: RunConfig, run_id: str, out_png: Path) -> Path:
    """Plot train and held-out reward against step, save it beside the run and log it (replaced each time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for key, label in (("reward/mean", "train reward (mean)"), ("eval/reward_mean", "held-out reward")):
        points = metric_history(cfg, run_id, key)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{cfg.trainer.run_name or 'run'}: {cfg.algorithm.adv_estimator}")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    log_file(cfg, run_id, out_png, "plots")
    return out_png
