"""The final policy and the best checkpoint as MLflow models: logged from their directories (the driver never
loads the weights), registered under `tracking.registered_model_name`, aliases `final` / `best`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow

from rlstages.configs import RunConfig
from rlstages.engines.imports import import_object
from rlstages.tasks.driver.tracking.store import client, tracking_uri


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
            meta = {**meta, "impl": import_object(f"{module}:{cls}", "transformers pipeline impl", "Class")}
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
