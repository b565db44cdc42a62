"""One flow iteration vs the same stage functions called in a bare Python loop (goal: ratio <= 1.05).

Both drive the same Ray workers; the loop calls each stage's plain function (`task.fn`), so the difference is
what Prefect adds (task runs, state tracking, concurrency) per iteration. The flow's per-step wall time is
read from MLflow's timestamps of `progress/step`. `python -m bench.bench_flow`
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.common import record, report, run_named, seconds_per_step, small_model, tiny_run_config


def _config(tmp: Path, model: Path, name: str, steps: int, tokens: int):  # type: ignore[no-untyped-def]
    """The bench's run (`common.tiny_run_config`) with its own settings."""
    return tiny_run_config(
        tmp,
        model,
        name,
        steps,
        "data.prompts_per_step=8",
        "rollout.n=4",
        f"rollout.max_new_tokens={tokens}",
        "data.source.num_train=512",
    )


def bare_loop(cfg, steps: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds per iteration of the stage functions without Prefect (after one warm-up iteration)."""
    from rlstages.tasks import advantage, reward, rollout, run, update
    from rlstages.tasks.advantage import initial_kl_state
    from rlstages.tasks.driver.workers import build_workers, forget_workers

    handle = run.prepare_run.fn(cfg)
    build_workers(cfg, handle)
    kl = initial_kl_state(cfg)
    marks = []
    for step in range(1, steps + 1):
        rollout.generate.fn(cfg, handle, step)
        reward.score_rewards.fn(cfg, handle, step)
        kl = advantage.advantages.fn(cfg, handle, step, kl).kl_state
        update.update_actor.fn(cfg, handle, step)
        rollout.sync_weights.fn(cfg, handle, step)
        marks.append(time.perf_counter())
    forget_workers(handle)
    return (marks[-1] - marks[0]) / (steps - 1)


def flow_iterations(cfg, steps: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds per iteration of the Prefect flow, from MLflow's step timestamps (after the first step)."""
    from rlstages.flows.train import rl_post_train

    rl_post_train(cfg)
    uri = cfg.tracking.tracking_uri
    return seconds_per_step(uri, run_named(uri, cfg.tracking.experiment, cfg.trainer.run_name))


SIZES = [(128, 4, 32), (512, 4, 96)]  # (hidden, layers, new tokens): a tiny model, then a small one


def main(steps: int = 6) -> None:
    """Alternate bare and flow runs twice per model size; report the best of each."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="rlstages-bench-flow-"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for hidden, layers, tokens in SIZES:
        model = small_model(hidden, layers, 512, name="bench-flow")
        bare, flow = [], []
        for rep in range(2):
            bare.append(bare_loop(_config(tmp, model, f"bare{hidden}-{rep}", steps, tokens), steps))
            flow.append(flow_iterations(_config(tmp, model, f"flow{hidden}-{rep}", steps, tokens), steps))
        case = f"hidden {hidden} x {layers}, 8 prompts x 4 x {tokens} tokens ({min(flow) - min(bare):+.3f} s/it)"
        rows.append((case, min(flow), min(bare), "<= 1.05"))
        record(
            "flow_tiny" if hidden == SIZES[0][0] else "flow_small",
            min(flow) / min(bare),
            "<= 1.05",
            f"{min(flow):.3f} vs {min(bare):.3f} s/it ({min(flow) - min(bare):+.3f} s), hidden {hidden}",
        )
    report("flow iteration vs bare loop of the same stage calls (ratio = flow / bare)", rows)
    ray.shutdown()


if __name__ == "__main__":
    main()
