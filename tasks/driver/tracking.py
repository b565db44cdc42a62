"""MLflow, and only here: one MLflow run per training run, resumed by id, metrics logged once per step.

MLflow is append-only, so a resumed or replayed run skips steps MLflow already has (tracked through the
`progress/step` metric). Everything goes through `MlflowClient` with an explicit run id, so stage tasks
on worker threads never depend on a thread's "active run".
"""

from __future__ import annotations

import contextlib
import getpass
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.utils import mlflow_tags

from rlstages.configs import RunConfig, config_hash, flatten, to_yaml

STEP_KEY = "progress/step"
_LAST_STEP: dict[str, int] = {}
_PENDING: list[Any] = []
DEFAULT_URI = "sqlite:///mlflow.db"


def tracking_uri(cfg: RunConfig | None = None) -> str:
    """`tracking.tracking_uri` when the config sets one (it wins), else MLFLOW_TRACKING_URI, else ./mlflow.db."""
    configured = cfg.tracking.tracking_uri if cfg is not None else None
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def tracking_uri_origin(cfg: RunConfig) -> tuple[str, str]:
    """(where the tracking URI comes from, the URI): the setting a user fixes when the store cannot work."""
    if cfg.tracking.tracking_uri:
        return "tracking.tracking_uri", cfg.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "MLFLOW_TRACKING_URI", os.environ["MLFLOW_TRACKING_URI"]
    return "the default tracking URI (set tracking.tracking_uri or MLFLOW_TRACKING_URI)", DEFAULT_URI


def store_problem(uri: str) -> str | None:
    """Why MLflow could not open the tracking store `uri` (None when it can), found without writing anything:
    an unknown scheme, a database file that is not one or cannot be created, a database driver that is not
    installed, a file store that this MLflow refuses, a server URI without a host."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry  # no public API

        registry.get_store_builder(uri)
    except (ImportError, AttributeError):  # another MLflow: its own error, later
        pass
    except Exception:  # noqa: BLE001 - MLflow's "unsupported URI" exception
        known = ", ".join(sorted(k for k in getattr(registry, "_registry", {}) if k))
        return f"has an unknown scheme {scheme!r} (MLflow knows {known}; e.g. sqlite:///mlflow.db)"
    if scheme in ("http", "https"):
        return None if urlparse(uri).hostname else "has no host (expected http://HOST:PORT)"
    if scheme in ("", "file"):
        return _file_store_problem(Path(urlparse(uri).path if scheme == "file" else uri))
    if scheme.partition("+")[0] in ("sqlite", "postgresql", "mysql", "mssql"):
        return _database_problem(uri)
    return None


def _file_store_problem(path: Path) -> str | None:
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE

    if not MLFLOW_ALLOW_FILE_STORE.get():
        return (
            f"is a file store, which MLflow {mlflow.__version__} opens only with MLFLOW_ALLOW_FILE_STORE=true; "
            "use a database such as sqlite:///mlflow.db"
        )
    if path.exists() and not path.is_dir():
        return f"names {path}, which is not a directory (expected an MLflow file store directory)"
    return _creatable(path)


def _database_problem(uri: str) -> str | None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        url.get_dialect().import_dbapi()
    except ArgumentError as exc:
        return f"is not a database URL ({exc})"
    except (ImportError, NoSuchModuleError) as exc:
        return f"needs a database driver that is not installed here ({type(exc).__name__}: {exc})"
    if not url.drivername.startswith("sqlite") or url.database in (None, "", ":memory:"):
        return None
    path = Path(url.database)
    if path.is_dir():
        return f"names {path}, which is a directory (expected an SQLite database file)"
    if path.exists():
        with open(path, "rb") as fh:
            head = fh.read(16)
        if head and head != b"SQLite format 3\x00":
            return f"names {path}, which is not an SQLite database"
        return None
    return _creatable(path)


def _creatable(path: Path) -> str | None:
    """Why `path` cannot be created (its nearest existing parent is a file, or not writable), else None."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def client(cfg: RunConfig) -> MlflowClient:
    """A client for the run's tracking URI (see `tracking_uri`)."""
    return MlflowClient(tracking_uri=tracking_uri(cfg))


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


def start_or_resume(cfg: RunConfig, run_name: str, run_id: str | None, flow_run_id: str | None) -> str:
    """Reattach to `run_id` (status back to RUNNING), or create the run with params, tags and the config."""
    c = client(cfg)
    if run_id is not None:
        c.update_run(run_id, status="RUNNING")
        c.set_tag(run_id, "rlstages.prefect_flow_run_id", flow_run_id or "none")
        _LAST_STEP[run_id] = last_logged_step(cfg, run_id)
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
    c.log_inputs(run_id, datasets=inputs)
    c.log_batch(run_id, metrics=rows)


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
    """Log one step's metrics in one batch; a step MLflow already has is skipped (returns False)."""
    if run_id not in _LAST_STEP:  # asked once per run and process, not on every step
        _LAST_STEP[run_id] = last_logged_step(cfg, run_id)
    if step <= _LAST_STEP[run_id]:
        return False
    now = int(time.time() * 1000)
    rows = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if _finite(v)]
    rows.append(Metric(STEP_KEY, float(step), now, step))
    c = client(cfg)
    for i in range(0, len(rows), 1000):  # asynchronous: `flush` before a checkpoint commits and at the end
        _PENDING.append(c.log_batch(run_id, metrics=rows[i : i + 1000], synchronous=False))
    _LAST_STEP[run_id] = step
    return True


def flush() -> None:
    """Wait until every asynchronously logged step has reached the tracking store."""
    while _PENDING:
        op = _PENDING.pop(0)
        if op is not None:
            op.wait()


def log_eval_metrics(cfg: RunConfig, run_id: str, step: int, metrics: dict[str, float]) -> None:
    """Evaluation metrics at `step` (kept separate: evaluation at step 0 precedes training)."""
    history = client(cfg).get_metric_history(run_id, "eval/reward_mean")
    if any(int(m.step) == step for m in history):
        return
    now = int(time.time() * 1000)
    client(cfg).log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items() if _finite(v)])


def _finite(v: Any) -> bool:
    try:
        return float(v) == float(v) and abs(float(v)) != float("inf")
    except (TypeError, ValueError):
        return False


def log_samples(cfg: RunConfig, run_id: str, step: int, rows: dict[str, list[Any]]) -> None:
    """Evaluation samples as an MLflow table (one file per evaluation, so nothing is re-uploaded)."""
    client(cfg).log_table(run_id, data=rows, artifact_file=f"eval/samples_step_{step:06d}.json")


def log_table(cfg: RunConfig, run_id: str, rows: dict[str, list[Any]], artifact_file: str) -> None:
    """Rows as an MLflow table artifact (one file per call)."""
    client(cfg).log_table(run_id, data=rows, artifact_file=artifact_file)


def metric_history(cfg: RunConfig, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of a metric, first value per step."""
    flush()
    seen: dict[int, float] = {}
    for m in client(cfg).get_metric_history(run_id, key):
        seen.setdefault(int(m.step), float(m.value))
    return sorted(seen.items())


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
    client(cfg).log_artifact(run_id, str(out_png), "plots")
    return out_png


def log_file(cfg: RunConfig, run_id: str, path: Path, artifact_dir: str) -> None:
    """Log a small file (a checkpoint manifest, a summary)."""
    client(cfg).log_artifact(run_id, str(path), artifact_dir)


def log_directory(cfg: RunConfig, run_id: str, local_dir: Path, artifact_path: str) -> None:
    """Log every file under `local_dir` at `artifact_path` (stage profiles)."""
    client(cfg).log_artifacts(run_id, str(local_dir), artifact_path)


def log_policy(cfg: RunConfig, run_id: str, hf_dir: Path, name: str = "policy", step: int | None = None) -> str | None:
    """An HF directory as an MLflow transformers model, logged from its path (the driver never loads the
    weights); registered under `tracking.registered_model_name` when set. Returns the registry version or None.
    """
    import transformers

    mlflow.set_tracking_uri(tracking_uri(cfg))
    with mlflow.start_run(run_id=run_id), _pipeline_classes():
        info = mlflow.transformers.log_model(
            transformers_model=str(hf_dir),
            name=name,
            task="text-generation",
            step=step or 0,
            registered_model_name=cfg.tracking.registered_model_name,
            pip_requirements=[f"transformers=={transformers.__version__}", "torch", "safetensors"],
        )
    version = getattr(info, "registered_model_version", None)
    return str(version) if version is not None else None


@contextlib.contextmanager
def _pipeline_classes() -> Iterator[None]:
    """MLflow 3.17 logs a checkpoint path by reading `check_task(task)[1]["impl"].__name__`, but transformers 5
    names the pipeline class as a dotted string there; resolve it to the class while the model is logged."""
    from transformers import pipelines

    original = pipelines.check_task

    def check_task(task: str) -> Any:
        name, meta, options = original(task)
        impl = meta.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            meta = {**meta, "impl": getattr(importlib.import_module(module), cls)}
        return name, meta, options

    pipelines.check_task = check_task  # type: ignore[assignment]
    try:
        yield
    finally:
        pipelines.check_task = original  # type: ignore[assignment]


def set_alias(cfg: RunConfig, alias: str, version: str) -> None:
    """Point registry alias `alias` of `tracking.registered_model_name` at `version`."""
    name = cfg.tracking.registered_model_name
    if name is not None:
        client(cfg).set_registered_model_alias(name, alias, version)


def set_tags(cfg: RunConfig, run_id: str, tags: dict[str, str]) -> None:
    """Set run tags (e.g. the failing stage)."""
    client(cfg).log_batch(run_id, tags=[RunTag(k, v[:8000]) for k, v in tags.items()])


def end(cfg: RunConfig, run_id: str, status: str) -> None:
    """End the run as FINISHED, FAILED or KILLED (MLflow never does it for a dead process)."""
    flush()
    client(cfg).set_terminated(run_id, status=status)


def run_link(cfg: RunConfig, run_id: str) -> str:
    """A URL of the run in the MLflow UI (`mlflow ui` on 127.0.0.1:5000 for a SQLite store)."""
    run = client(cfg).get_run(run_id)
    uri = tracking_uri(cfg)
    base = uri if uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"


# ---- experiment comparison (`rlstages compare`): read-only queries by tracking URI, no RunConfig needed ----


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


def compare_link(tracking_uri: str, exp_id: str, run_ids: list[str]) -> str | None:
    """The MLflow UI's compare view of these runs (only for an HTTP tracking server)."""
    if not tracking_uri.startswith("http"):
        return None
    import json

    runs = json.dumps(run_ids, separators=(",", ":"))
    return f"{tracking_uri.rstrip('/')}/#/compare-runs?runs={runs}&experiments={json.dumps([exp_id])}"
