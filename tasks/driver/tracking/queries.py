"""Experiment comparison (`rlstages compare`, `rlstages replay`): read-only queries by tracking URI, no RunConfig
needed."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from mlflow import MlflowClient


@dataclass(frozen=True)
class RunRecord:
    """One MLflow run as `rlstages compare` shows it: status, times, params (the flat config), tags, metrics."""

    run_id: str
    name: str
    status: str
    start_ms: int
    end_ms: int | None
    params: dict[str, str]
    tags: dict[str, str]
    latest: dict[str, float]

    @property
    def wall_seconds(self) -> float:
        """Start to end (to now for a running run)."""
        end = self.end_ms if self.end_ms else int(time.time() * 1000)
        return max(0.0, (end - self.start_ms) / 1000.0)


def experiment_id(tracking_uri: str, experiment: str | None) -> tuple[str, str]:
    """(id, name) of `experiment`, or of the most recently updated experiment when None."""
    c = MlflowClient(tracking_uri=tracking_uri)
    if experiment is None:
        found = c.search_experiments(max_results=1, order_by=["last_update_time DESC"])
        if not found:
            raise ValueError(f"no experiments in {tracking_uri}")
        return found[0].experiment_id, found[0].name
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in c.search_experiments(max_results=50))
        raise ValueError(f"no experiment {experiment!r} in {tracking_uri}; experiments: {', '.join(names) or 'none'}")
    return exp.experiment_id, exp.name


def experiment_runs(tracking_uri: str, exp_id: str, max_runs: int = 8, filter_string: str = "") -> list[RunRecord]:
    """The newest `max_runs` runs of an experiment (optionally filtered, MLflow search syntax), oldest first."""
    c = MlflowClient(tracking_uri=tracking_uri)
    runs = c.search_runs([exp_id], filter_string=filter_string, max_results=max_runs, order_by=["start_time DESC"])
    return [
        RunRecord(
            run_id=r.info.run_id,
            name=r.info.run_name or r.info.run_id[:8],
            status=r.info.status,
            start_ms=int(r.info.start_time or 0),
            end_ms=int(r.info.end_time) if r.info.end_time else None,
            params=dict(r.data.params),
            tags={k: v for k, v in r.data.tags.items() if not k.startswith("mlflow.")},
            latest=dict(r.data.metrics),
        )
        for r in reversed(list(runs))
    ]


def metric_series(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of a metric, the first value logged per step, by step."""
    seen: dict[int, float] = {}
    for m in MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, key):
        seen.setdefault(int(m.step), float(m.value))
    return sorted(seen.items())


def step_metrics(tracking_uri: str, run_id: str, prefixes: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """Every metric of the run whose key starts with one of `prefixes`, by step (the first value per step)."""
    c = MlflowClient(tracking_uri=tracking_uri)
    steps: dict[int, dict[str, float]] = {}
    for key in (k for k in c.get_run(run_id).data.metrics if k.startswith(prefixes)):
        for m in c.get_metric_history(run_id, key):
            steps.setdefault(int(m.step), {}).setdefault(key, float(m.value))
    return steps


def metric_histories(tracking_uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run with every (step, value) it logged, sorted (`rlstages replay` compares two runs)."""
    c = MlflowClient(tracking_uri=tracking_uri)
    keys = sorted(c.get_run(run_id).data.metrics)
    return {k: sorted((int(m.step), float(m.value)) for m in c.get_metric_history(run_id, k)) for k in keys}


def compare_link(tracking_uri: str, exp_id: str, run_ids: list[str]) -> str | None:
    """The MLflow UI's compare view of these runs (only for an HTTP tracking server)."""
    if not tracking_uri.startswith("http"):
        return None
    runs = json.dumps(run_ids, separators=(",", ":"))
    return f"{tracking_uri.rstrip('/')}/#/compare-runs?runs={runs}&experiments={json.dumps([exp_id])}"
