"""What `rlstages run` begins before its flow, so the flow finds it ready: the model's build (a provider's
conversion) and the run's services (Prefect's temporary server, its own local Ray). Each waits in the flow where
it is needed (`prepare_run`, `start_temporary_server`, `start_workers`), which also reports its errors."""

from __future__ import annotations

from rlstages.configs import RunConfig


def build_model_early(cfg: RunConfig) -> None:
    """A provider's model not built yet (the demo's first run: SmolLM2 dequantised from its GGUF, ~10 s) is built
    in the background from here, while Prefect, MLflow and the run directory start; the flow's `prepare_run`
    waits for it."""
    from rlstages.engines.models import start_model_build

    tiny = cfg.model.tiny.model_dump() if cfg.model.tiny else None
    start_model_build(cfg.model.path, cfg.model.provider, tiny, cfg.model.revision)


def start_services_early(cfg: RunConfig) -> None:
    """Prefect's temporary server starts in the background while the run's local Ray starts here (~3 s each, one
    after the other before): the flow waits for the server, `start_workers` finds Ray up."""
    from rlstages.tasks.driver.cluster import start_local_ray_early
    from rlstages.tasks.prefect_api import start_temporary_server_in_background

    start_temporary_server_in_background()
    start_local_ray_early(cfg)
