"""Evaluation stage: held-out prompts sampled as in training (k per prompt: mean@k, unbiased pass@k) and/or
greedily, scored, per data source, logged with samples, a reward curve and a markdown summary in Prefect.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.rewards.metrics import group_metrics
from rlstages.engines.rollout.trajectory import rollout_metrics
from rlstages.engines.types import SamplingParams
from rlstages.tasks import prefect_api
from rlstages.tasks.driver import tracking
from rlstages.tasks.driver.context import RunHandle, derive_seed
from rlstages.tasks.driver.data.loading import eval_prompts, tokenizer_path
from rlstages.tasks.reward import score_batch
from rlstages.tasks.rollout import sampling
from rlstages.tasks.stage_workers import stage_workers


def _correct_by_prompt(batch: Any, scores: Any, threshold: float) -> dict[str, tuple[str, list[bool]]]:
    """Prompt uid -> (data source, correctness of each of its samples), in batch order."""
    groups: dict[str, tuple[str, list[bool]]] = {}
    sources = T.get_rows(batch, "data_source") if "data_source" in batch.keys() else [""] * len(scores)
    for uid, source, score in zip(T.get_rows(batch, "uid"), sources, scores.tolist(), strict=True):
        groups.setdefault(uid, (source, []))[1].append(score > threshold)
    return groups


def _per_source(groups: dict[str, tuple[str, list[bool]]], name: str) -> dict[str, float]:
    """`eval/<name>` overall and, with several data sources, `eval/<source>/<name>` (metrics over groups)."""
    sources = sorted({s for s, _ in groups.values()})
    out: dict[str, float] = {}
    for prefix, keep in [("eval/", None)] + ([(f"eval/{s}/", s) for s in sources] if len(sources) > 1 else []):
        chosen = [g for s, g in groups.values() if keep is None or s == keep]
        if name == "greedy":
            out[f"{prefix}greedy_accuracy"] = sum(g[0] for g in chosen) / len(chosen)
        else:
            out.update(group_metrics(chosen, prefix))
    return out


def run_eval(
    cfg: RunConfig, run: RunHandle, step: int, greedy: bool = False, k: int | None = None
) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """Score the held-out prompts: a sampled pass of k samples each (mean@k, pass@j; skipped when only
    `greedy` is asked with k=1) and a greedy pass when asked here or in `evaluation.greedy`: (metrics, rows)."""
    w = stage_workers(cfg, run, "evaluate")
    k = k or cfg.evaluation.k
    base = sampling(cfg, evaluation=True)
    prompts = eval_prompts(cfg.data, tokenizer_path(cfg))
    seed = derive_seed(cfg.trainer.seed, step, "evaluate")
    w.rollout.wake()
    metrics: dict[str, float] = {}
    passes = []
    if greedy or cfg.evaluation.greedy:
        passes.append(
            ("greedy", SamplingParams(n=1, temperature=0.0, max_new_tokens=base.max_new_tokens, stop=base.stop))
        )
    if not greedy or k > 1:
        passes.insert(0, ("sampled", replace(base, n=k)))
    rows: dict[str, list[Any]] = {}
    for name, params in passes:
        batch = w.rollout.generate(prompts, params, seed)
        scores, _ = score_batch(cfg, w, batch)
        groups = _correct_by_prompt(batch, scores, cfg.evaluation.correct_above)
        metrics.update(_per_source(groups, name))
        prefix = "eval/greedy_" if name == "greedy" else "eval/"
        metrics[f"{prefix}reward_mean"] = float(scores.mean())
        metrics[f"{prefix}response_length"] = float(batch[T.RESPONSE_MASK].sum(-1).float().mean())
        for key, value in rollout_metrics(batch).items():  # multi-turn: how often the tools were called
            if key.startswith("tools/") or key == "rollout/turns_mean":
                metrics[f"{prefix}{key.replace('/', '_')}"] = value
        if name == "sampled":
            metrics["eval/accuracy"] = metrics[f"eval/mean_at_{k}"]
        if not rows:
            rows = {
                "step": [step] * len(scores),
                "prompt": T.get_rows(batch, "prompt"),
                "response": T.get_rows(batch, "response"),
                "ground_truth": T.get_rows(batch, "ground_truth"),
                "score": [float(s) for s in scores],
            }
    if "eval/reward_mean" not in metrics:  # greedy only (`rlstages eval`): its numbers are the headline
        metrics["eval/reward_mean"] = metrics["eval/greedy_reward_mean"]
        metrics["eval/accuracy"] = metrics["eval/greedy_accuracy"]
        metrics["eval/response_length"] = metrics["eval/greedy_response_length"]
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
    prefect_api.best_effort(
        lambda: create_markdown_artifact(
            key=f"eval-{run.name.lower().replace('_', '-')}"[:60],
            markdown=(
                f"### Evaluation at step {step}\n\nheld-out reward **{metrics['eval/reward_mean']:.3f}** "
                f"(accuracy {metrics['eval/accuracy']:.3f}, mean length {metrics['eval/response_length']:.1f})\n\n"
                f"| prompt | response | score |\n|---|---|---|\n{table}\n"
            ),
            description=f"held-out evaluation, step {step}",
        ),
        "the evaluation artifact",
    )
    return metrics
