"""One-step-off-policy generation vs synchronous, on the split layout (rollout and trainer in separate Ray workers).

Both runs use the same config (token-level TIS on, so both compute old log-probs) except
`trainer.one_step_off_policy`; the off-policy run generates step k+1 while step k trains. Reports the wall time per
step (MLflow step timestamps, after the first step) as a ratio off / sync, and both reward curves.
`python -m bench.bench_off_policy [steps]`
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import record, report, run_named, seconds_per_step, small_model, tiny_run_config


def _config(tmp: Path, model: Path, name: str, steps: int, off_policy: bool):  # type: ignore[no-untyped-def]
    """The bench's run (`common.tiny_run_config`) with its own settings."""
    return tiny_run_config(
        tmp,
        model,
        name,
        steps,
        f"trainer.one_step_off_policy={str(off_policy).lower()}",
        "cluster.hybrid_engine=false",
        "cluster.colocate=false",
        "algorithm.rollout_is.level=token",
        "data.prompts_per_step=8",
        "rollout.n=4",
        "rollout.max_new_tokens=32",
        "data.source.num_train=512",
    )


def run(cfg) -> tuple[float, list[float], list[float]]:  # type: ignore[no-untyped-def]
    """(seconds per step after the first, reward/mean per step, rollout_corr/kl per step) of one flow run."""
    from mlflow import MlflowClient

    from rlstages.flows.train import rl_post_train

    rl_post_train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    run_id = run_named(cfg.tracking.tracking_uri, cfg.tracking.experiment, cfg.trainer.run_name)

    def curve(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    return seconds_per_step(cfg.tracking.tracking_uri, run_id), curve("reward/mean"), curve("rollout_corr/kl")


def main(steps: int = 6) -> None:
    """Alternate synchronous and off-policy runs twice; report the best step time of each and the curves."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="rlstages-bench-offpolicy-"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    model = small_model(128, 4, 512, name="bench-offpolicy")
    results: dict[bool, list[tuple[float, list[float], list[float]]]] = {False: [], True: []}
    for rep in range(2):
        for off in (False, True):
            results[off].append(run(_config(tmp, model, f"{'off' if off else 'sync'}-{rep}", steps, off)))
    sync, off = (min(results[k], key=lambda r: r[0]) for k in (False, True))
    report(
        "step time, one-step off-policy vs synchronous (ratio = off / sync), hidden 128 x 4, 8 prompts x 4 x 32 tok",
        [(f"{steps} steps, split layout, token TIS", off[0], sync[0], "< 1 (overlap)")],
    )
    record("off_policy_step_time", off[0] / sync[0], "<= 1.0", "one-step off-policy / synchronous, split layout")
    table = Table("run", "reward/mean per step", "mean", "rollout_corr/kl per step", title="reward curves")
    for name, rows in (("sync", results[False]), ("off-policy", results[True])):
        for i, (_, reward, kl) in enumerate(rows):
            fmt = " ".join(f"{r:.3f}" for r in reward)
            table.add_row(f"{name} #{i}", fmt, f"{sum(reward) / len(reward):.3f}", " ".join(f"{k:.1e}" for k in kl))
    Console().print(table)
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
