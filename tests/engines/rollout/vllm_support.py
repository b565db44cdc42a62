"""A `VLLMRolloutEngine` in a Ray actor running `.venv-vllm`'s interpreter, as every vLLM test starts and stops it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def vllm_actor(ray: Any, model_dir: Path, **kwargs: Any) -> Iterator[Any]:
    """The engine on `model_dir` as an actor (num_cpus=0: scheduled even while other modules' actors hold the
    session's CPUs; vLLM pins its own threads), shut down and killed on exit."""
    from rlstages.engines.rollout.vllm_rollout import VLLMRolloutEngine, vllm_actor_options

    actor = ray.remote(VLLMRolloutEngine).options(**vllm_actor_options(), num_cpus=0).remote(str(model_dir), **kwargs)
    try:
        yield actor
    finally:
        try:
            ray.get(actor.shutdown.remote(), timeout=60)
        finally:
            ray.kill(actor)


def call(actor: Any, method: str, *args: Any) -> Any:
    """`actor.method(*args)`, waited for (10 minutes at most: vLLM on two shared cores)."""
    import ray

    return ray.get(getattr(actor, method).remote(*args), timeout=600)
