"""One MLflow run per training run, resumed by id, metrics logged once per step; params, tags, datasets,
tables and files of the run.

MLflow is append-only, so a resumed or replayed run skips steps MLflow (or the run's journal) already has
(tracked through the `progress/step` metric). Everything goes through `MlflowClient` with an explicit run id,
so stage tasks on worker threads never depend on a thread's "active run". A run started with its run
directory logs through the journal there (`journal`, `outbox`): an MLflow server away for minutes stops
nothing, and what it missed is sent in order when it answers.
"""

from __future__ import annotations

import getpass
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.utils import mlflow_tags

from rlstages.configs import RunConfig, config_hash, flatten, to_yaml
from rlstages.engines.runtime.compile_time import COMPILE_METRIC
from rlstages.tasks.driver.tracking.outbox import close_outbox, journal_of, open_outbox, outbox_of
from rlstages.tasks.driver.tracking.queries import metric_series
from rlstages.tasks.driver.tracking.store import client, tracking_uri

log = logging.getLogger("rlstages.tracking")

STEP_KEY = "progress/step"
_LAST_STEP: dict[str, int] = {}
_PENDING: list[Any] = []
BACKLOG_WAIT_S = 120.0  # a resumed run waits this long for MLflow to take what an earlier process left unsent


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def system_tags(commit: str) -> dict[str, str]:
    """MLflow's own `mlflow.source.*` / `mlflow.user` tags (the UI's source and user columns read them)."""
    tags = {
        mlflow_tags.MLFLOW_SOURCE_NAME: os.path.basename(sys.argv[0]) or "rlstages",
        mlflow_tags.MLFLOW_SOURCE_TYPE: "LOCAL",
        mlflow_tags.MLFLOW_USER: _user(),
    }
    if commit != "unknown":
        tags[mlflow_tags.MLFLOW_GIT_COMMIT] = commit
    return tags


def run_tags(cfg: RunConfig, flow_run_id: str | None) -> dict[str, str]:
    """The tags experiments are compared by, plus MLflow's system tags."""
    commit = _git_commit()
    return {
        **system_tags(commit),
        "rlstages.config_hash": config_hash(cfg),
        "rlstages.git_commit": commit,
        "rlstages.model": str(cfg.model.path.name),
        "rlstages.algorithm": cfg.algorithm.adv_estimator,
        "rlstages.rollout_backend": cfg.rollout.backend,
        "rlstages.actor_backend": cfg.actor.backend,
        "rlstages.prefect_flow_run_id": flow_run_id or "none",
    }


def start_or_resume(
    cfg: RunConfig, run_name: str, run_id: str | None, flow_run_id: str | None, run_dir: Path | None = None
) -> str:
    """Reattach to `run_id` (status back to RUNNING), or create the run with params, tags and the config.
    With `run_dir`, the run's calls go through its journal there (`outbox`): what an earlier process left
    unsent is sent first, before the run is reopened."""
    c = client(cfg)
    if run_id is not None:
        box = open_outbox(run_id, run_dir, tracking_uri(cfg)) if run_dir is not None else None
        if box is not None and box.flush(BACKLOG_WAIT_S):
            raise RuntimeError(
                f"MLflow at {tracking_uri(cfg)} does not answer ({box.last_error or 'no answer'}); "
                f"{box.journal.count_unsent()} tracking calls of the earlier run are still unsent in {box.journal.dir}"
            )
        c.update_run(run_id, status="RUNNING")
        c.set_tag(run_id, "rlstages.prefect_flow_run_id", flow_run_id or "none")
        journaled = box.journal.last_step(run_id) if box is not None else 0
        _LAST_STEP[run_id] = max(last_logged_step(cfg, run_id), journaled)
        if box is not None and box.journal.get(f"experiment:{run_id}") is None:
            box.journal.put(f"experiment:{run_id}", c.get_run(run_id).info.experiment_id)
        return run_id
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = exp.experiment_id if exp is not None else c.create_experiment(cfg.tracking.experiment)
    run = c.create_run(exp_id, run_name=run_name, tags=run_tags(cfg, flow_run_id))
    rid = run.info.run_id
    params = [Param(k, v[:6000]) for k, v in flatten(cfg.model_dump(mode="json")).items()]
    for i in range(0, len(params), 100):
        c.log_batch(rid, params=params[i : i + 100])
    c.log_text(rid, to_yaml(cfg), "config/resolved.yaml")
    _LAST_STEP[rid] = 0
    if run_dir is not None:
        journal = open_outbox(rid, run_dir, tracking_uri(cfg)).journal
        journal.put(f"experiment:{rid}", exp_id)
        journal.put(f"complete:{rid}", "1")  # every metric of the run is journaled: plots read the journal
    return rid


def log_dataset(cfg: RunConfig, run_id: str, record: dict[str, dict[str, Any]]) -> None:
    """Record each split as an MLflow dataset input (source, content digest; runs compare by data) and the
    row counts, including prompts dropped by the length filter, as `data/*` metrics at step 0."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    inputs, rows = [], []
    now = int(time.time() * 1000)
    for split, info in record.items():
        ds = MetaDataset(  # type: ignore[abstract]  # mlflow: Dataset is not an ABC; `profile` is not enforced
            _dataset_source(str(info["source"])), name=f"{split}: {info['source']}"[:500], digest=info["digest"]
        )
        inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", split)]))
        rows += [Metric(f"data/{split}_rows", float(info["rows"]), now, 0)]
        rows += [Metric(f"data/{split}_dropped_prompts", float(info["dropped"]), now, 0)]
    c = client(cfg)
    log_inputs_once_stored(c, run_id, inputs)
    c.log_batch(run_id, metrics=rows)


def log_inputs_once_stored(c: Any, run_id: str, inputs: list[Any], tries: int = 3) -> None:
    """`log_inputs`, retried when another run stored the same dataset between MLflow's look-up and its insert
    (its SQL store checks, then inserts: two runs logging one dataset at once get a UNIQUE-constraint error)."""
    for attempt in range(tries):
        try:
            c.log_inputs(run_id, datasets=inputs)
            return
        except Exception as e:  # MlflowException (SQL store) or RestException (server) wrapping the IntegrityError
            if attempt == tries - 1 or not _is_duplicate_insert(e):
                raise


def _is_duplicate_insert(e: Exception) -> bool:
    text = str(e).lower()
    return "unique constraint" in text or "duplicate key" in text or "duplicate entry" in text


def _dataset_source(where: str) -> Any:
    """A local file's source, a hub dataset's, or a code source naming a synthetic dataset."""
    path = where.split(" [")[0]
    if path.startswith("hub dataset "):
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        return HuggingFaceDatasetSource(path=path.removeprefix("hub dataset "))
    if Path(path).exists():
        import warnings

        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are the local source
            warnings.simplefilter("ignore", UserWarning)
            return resolve_dataset_source(str(Path(path).resolve()))
    from mlflow.data.code_dataset_source import CodeDatasetSource

    return CodeDatasetSource(tags={"source": where})


def last_logged_step(cfg: RunConfig, run_id: str) -> int:
    """The newest step MLflow already holds for this run (0 if none)."""
    history = client(cfg).get_metric_history(run_id, STEP_KEY)
    return max((int(m.step) for m in history), default=0)


def log_step(cfg: RunConfig, run_id: str, step: int, metrics: dict[str, float]) -> bool:
    """Log one step's metrics in one batch; a step MLflow (or the run's journal) already has is skipped
    (returns False). A journaled run returns at once: the outbox sends it."""
    if run_id not in _LAST_STEP:  # asked once per run and process, not on every step
        _LAST_STEP[run_id] = last_logged_step(cfg, run_id)
    if step <= _LAST_STEP[run_id]:
        return False
    now = int(time.time() * 1000)
    rows = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if _finite(v)]
    rows.append(Metric(STEP_KEY, float(step), now, step))
    box = outbox_of(run_id)
    for i in range(0, len(rows), 1000):
        chunk = rows[i : i + 1000]
        if box is not None:  # the chunk holding STEP_KEY (the last) goes last: a step counts once it is whole
            box.post(run_id, "metrics", {"metrics": [[m.key, m.value, m.timestamp, m.step] for m in chunk]}, step)
        else:  # asynchronous: `flush` before a checkpoint commits and at the end
            _PENDING.append(client(cfg).log_batch(run_id, metrics=chunk, synchronous=False))
    _LAST_STEP[run_id] = step
    return True


def flush(run_id: str | None = None, timeout: float = 60.0) -> int:
    """Wait until every logged step has reached the tracking store; with a journaled `run_id`, at most
    `timeout` seconds and no longer once MLflow is known to be away. Returns how many calls are still unsent."""
    while _PENDING:
        op = _PENDING.pop(0)
        if op is not None:
            op.wait()
    box = outbox_of(run_id) if run_id is not None else None
    return box.flush(timeout, while_down=False) if box is not None else 0


def log_eval_metrics(cfg: RunConfig, run_id: str, step: int, metrics: dict[str, float]) -> None:
    """Evaluation metrics at `step` (kept separate: evaluation at step 0 precedes training)."""
    box = outbox_of(run_id)
    if box is not None and box.journal.has_step(run_id, "eval", step):
        return
    if not _journal_complete(run_id) and any(
        int(m.step) == step for m in client(cfg).get_metric_history(run_id, "eval/reward_mean")
    ):
        return
    now = int(time.time() * 1000)
    rows = [Metric(k, float(v), now, step) for k, v in metrics.items() if _finite(v)]
    if box is not None:
        box.post(run_id, "eval", {"metrics": [[m.key, m.value, m.timestamp, m.step] for m in rows]}, step)
    else:
        client(cfg).log_batch(run_id, metrics=rows)


def log_run_metrics(cfg: RunConfig, run_id: str, step: int, metrics: dict[str, float]) -> None:
    """Metrics about the run itself at `step` (an evaluation's seconds, the run's evaluation share): journaled
    without a step of their own, so a step's or an evaluation's own entry is never taken for them; a key
    already logged at `step` (a replayed evaluation) is not logged again."""
    now = int(time.time() * 1000)
    rows = [Metric(k, float(v), now, step) for k, v in metrics.items() if _finite(v) and not _has(cfg, run_id, k, step)]
    if not rows:
        return
    box = outbox_of(run_id)
    if box is not None:
        box.post(run_id, "metrics", {"metrics": [[m.key, m.value, m.timestamp, m.step] for m in rows]})
    else:
        client(cfg).log_batch(run_id, metrics=rows)


def _has(cfg: RunConfig, run_id: str, key: str, step: int) -> bool:
    """Whether metric `key` has a point at `step` (in the run's journal when it holds the whole run, else MLflow)."""
    journal = journal_of(run_id)
    if journal is not None and _journal_complete(run_id):
        return step in journal.points(run_id, key)
    return any(int(m.step) == step for m in client(cfg).get_metric_history(run_id, key))


def _journal_complete(run_id: str) -> bool:
    """Whether the run's journal holds every metric the run logged (it was created with the run)."""
    journal = journal_of(run_id)
    return journal is not None and journal.get(f"complete:{run_id}") == "1"


def _finite(v: Any) -> bool:
    try:
        return float(v) == float(v) and abs(float(v)) != float("inf")
    except (TypeError, ValueError):
        return False


def log_samples(cfg: RunConfig, run_id: str, step: int, rows: dict[str, list[Any]]) -> None:
    """Evaluation samples as an MLflow table (one file per evaluation, so nothing is re-uploaded)."""
    log_table(cfg, run_id, rows, f"eval/samples_step_{step:06d}.json")


def log_table(cfg: RunConfig, run_id: str, rows: dict[str, list[Any]], artifact_file: str) -> None:
    """Rows as an MLflow table artifact (one file per call)."""
    box = outbox_of(run_id)
    if box is not None:
        box.post(run_id, "table", {"data": rows, "artifact_file": artifact_file})
    else:
        client(cfg).log_table(run_id, data=rows, artifact_file=artifact_file)


def metric_history(cfg: RunConfig, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of a metric, first value per step: from the run's journal when it holds the whole
    run (no server needed), else from MLflow."""
    journal = journal_of(run_id)
    if journal is not None and _journal_complete(run_id):
        return sorted(journal.points(run_id, key).items())
    flush(run_id)
    seen: dict[int, float] = {}
    for m in client(cfg).get_metric_history(run_id, key):
        seen.setdefault(int(m.step), float(m.value))
    for step, value in (journal.points(run_id, key) if journal is not None else {}).items():
        seen.setdefault(step, value)
    return sorted(seen.items())


def earlier_step_seconds(cfg: RunConfig, run_id: str) -> tuple[float, ...]:
    """Each step's seconds (`timing/step_s`, step 1's compiling left out) in the newest finished run of this config
    (the `rlstages.config_hash` tag) in the run's experiment other than `run_id`; () where there is none, or the
    store does not answer. The ETA takes its shape: a step's cost follows its replies' length, which the first step
    cannot foresee and an earlier run of the same config has seen."""
    total = cfg.trainer.total_steps
    try:
        c = client(cfg)
        exp = c.get_experiment_by_name(cfg.tracking.experiment)
        if exp is None:
            return ()
        same = f"tags.`rlstages.config_hash` = '{config_hash(cfg)}' and attributes.status = 'FINISHED'"
        for found in c.search_runs([exp.experiment_id], same, max_results=4, order_by=["start_time DESC"]):
            if found.info.run_id == run_id:
                continue
            steps = dict(metric_series(tracking_uri(cfg), found.info.run_id, "timing/step_s"))
            if not all(k in steps for k in range(1, total + 1)):
                continue
            for key in (k for k in found.data.metrics if k.startswith(COMPILE_METRIC)):
                steps[1] -= dict(metric_series(tracking_uri(cfg), found.info.run_id, key)).get(1, 0.0)
            return tuple(max(steps[k], 0.0) for k in range(1, total + 1))
    except Exception as exc:  # noqa: BLE001 - only the ETA's shape is lost: it falls back to the steps it measures
        log.warning(f"no earlier run's step times for the ETA ({type(exc).__name__}: {exc})")
    return ()


def log_file(cfg: RunConfig, run_id: str, path: Path, artifact_dir: str) -> None:
    """Log a small file (a checkpoint manifest, a summary); a journaled run sends a copy taken now."""
    _log_path(cfg, run_id, path, artifact_dir)


def log_directory(cfg: RunConfig, run_id: str, local_dir: Path, artifact_path: str) -> None:
    """Log every file under `local_dir` at `artifact_path` (stage profiles)."""
    _log_path(cfg, run_id, local_dir, artifact_path)


def _log_path(cfg: RunConfig, run_id: str, path: Path, artifact_dir: str) -> None:
    box = outbox_of(run_id)
    if box is not None:
        box.post(run_id, "artifact", {"path": box.journal.keep_file(path, path.name), "dir": artifact_dir})
    elif path.is_dir():
        client(cfg).log_artifacts(run_id, str(path), artifact_dir)
    else:
        client(cfg).log_artifact(run_id, str(path), artifact_dir)


def set_tags(cfg: RunConfig, run_id: str, tags: dict[str, str]) -> None:
    """Set run tags (e.g. the failing stage)."""
    box = outbox_of(run_id)
    if box is not None:
        box.post(run_id, "tags", {"tags": {k: v[:8000] for k, v in tags.items()}})
    else:
        client(cfg).log_batch(run_id, tags=[RunTag(k, v[:8000]) for k, v in tags.items()])


def end(cfg: RunConfig, run_id: str, status: str, wait_s: float = 0.0) -> int:
    """End the run as FINISHED, FAILED or KILLED (MLflow never does it for a dead process). A journaled run
    waits up to `wait_s` for an away server; returns how many calls stay unsent (a resumed run sends them)."""
    box = outbox_of(run_id)
    if box is None:
        flush()
        client(cfg).set_terminated(run_id, status=status)
        return 0
    box.post(run_id, "terminate", {"status": status, "end_time": int(time.time() * 1000)})
    unsent = box.flush(max(wait_s, 1.0))
    close_outbox(run_id)
    _LAST_STEP.pop(run_id, None)
    return unsent


def wait_for_backlog(run_id: str, wait_s: float) -> int:
    """Wait up to `wait_s` for a journaled run's unsent calls to reach MLflow (before logging a model, which
    needs the server); returns how many are still unsent."""
    box = outbox_of(run_id)
    return box.flush(wait_s) if box is not None else 0


def run_link(cfg: RunConfig, run_id: str) -> str:
    """A URL of the run in the MLflow UI (`mlflow ui` on 127.0.0.1:5000 for a SQLite store)."""
    journal = journal_of(run_id)
    experiment = journal.get(f"experiment:{run_id}") if journal is not None else None
    if experiment is None:
        experiment = client(cfg).get_run(run_id).info.experiment_id
    uri = tracking_uri(cfg)
    base = uri if uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
