"""Evaluation stage: held-out prompts sampled as in training (or greedy), scored, logged with samples,
a reward curve and a markdown summary artifact in Prefect.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.types import SamplingParams
from rlstages.tasks import tracking
from rlstages.tasks.context import RunHandle, derive_seed
from rlstages.tasks.data import eval_prompts, tokenizer_path
from rlstages.tasks.policies import guard_workers
from rlstages.tasks.reward import score_batch
from rlstages.tasks.rollout import sampling
from rlstages.tasks.workers import get_workers


def run_eval(
    cfg: RunConfig, run: RunHandle, step: int, greedy: bool = False
) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """Generate one sample per held-out prompt and score it: (metrics, sample rows)."""
    workers = get_workers(cfg, run)
    timeout = cfg.prefect.policy("evaluate").timeout_seconds
    params = sampling(cfg, evaluation=True)
    if greedy:
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=params.max_new_tokens, stop=params.stop)
    prompts = eval_prompts(cfg.data, tokenizer_path(cfg))
    seed = derive_seed(cfg.trainer.seed, step, "evaluate")
    guard_workers(lambda: workers.rollout.all(timeout).wake())
    batch = guard_workers(lambda: workers.rollout.dp(timeout).generate(prompts, params, seed))
    scores, _ = score_batch(cfg, workers, batch, timeout)
    lengths = batch[T.RESPONSE_MASK].sum(-1)
    metrics = {
        "eval/reward_mean": float(scores.mean()),
        "eval/accuracy": float((scores > 0).float().mean()),
        "eval/response_length": float(lengths.mean()),
    }
    rows = {
        "step": [step] * len(prompts),
        "prompt": T.get_rows(batch, "prompt"),
        "response": T.get_rows(batch, "response"),
        "ground_truth": T.get_rows(batch, "ground_truth"),
        "score": [float(s) for s in scores],
    }
    return metrics, rows


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(cfg: RunConfig, run: RunHandle, step: int, mlflow_run_id: str) -> dict[str, float]:
    """Held-out reward at `step`; logs metrics, a samples table, the reward curve PNG and a Prefect summary."""
    start = time.perf_counter()
    metrics, rows = run_eval(cfg, run, step)
    metrics["timing/evaluate_s"] = time.perf_counter() - start
    tracking.log_eval_metrics(cfg, mlflow_run_id, step, metrics)
    keep = cfg.tracking.log_samples
    if keep:
        tracking.log_samples(cfg, mlflow_run_id, step, {k: v[:keep] for k, v in rows.items()})
    tracking.log_reward_curve(cfg, mlflow_run_id, run.path / "reward_curve.png")
    table = "\n".join(
        f"| {p[:60]} | {r[:60]!r} | {s:.2f} |"
        for p, r, s in zip(rows["prompt"][:8], rows["response"][:8], rows["score"][:8], strict=True)
    )
    create_markdown_artifact(
        key=f"eval-{run.name.lower().replace('_', '-')}"[:60],
        markdown=(
            f"### Evaluation at step {step}\n\nheld-out reward **{metrics['eval/reward_mean']:.3f}** "
            f"(accuracy {metrics['eval/accuracy']:.3f}, mean length {metrics['eval/response_length']:.1f})\n\n"
            f"| prompt | response | score |\n|---|---|---|\n{table}\n"
        ),
        description=f"held-out evaluation, step {step}",
    )
    return metrics
