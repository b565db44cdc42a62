"""The memory plan (`rlstages plan`, driver/memory_plan/) against what a training rank really holds, for the CPU runs
the suite already makes (torch, DeepSpeed, Megatron-Core at TP / PP / EP): `measure_step(engine, batch)` runs one
train step inside a rank (`ActorGroup.each`, or in-process) and measures
  - state: the bytes of every tensor storage reachable from the engine object (weights, gradients, optimizer
    states, ZeRO partitions; each storage once) at its fullest, right after the optimizer's step (a global
    `torch.optim` step post-hook: gradients not yet cleared, Adam's moments created);
  - activations: the peak of the bytes saved for backward and still alive (`saved_tensors_hooks`: each saved
    storage once, the weights left out, ZeRO-3's gathered ones too; a storage counts until the graph that saved it
    is freed), which under 1F1B includes every micro-batch in flight on the rank's stage, and the saved logits.
`check_ranks` compares them with the plan's rank of the same stage (`planned_rank`) within
STATE_TOLERANCE and ACTIVATION_TOLERANCE (docs/production.md, "Memory plan", states the method and figures).
Test helpers, not a test module: shipped to Ray workers by value (`register`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from rlstages.engines.runtime.tensor_census import reachable_tensor_bytes

ROOT = Path(__file__).resolve().parents[2]
# measured / planned. State: weights + gradients + optimizer states (+ ZeRO-3's bucket): measured 1.000-1.022 on
# torch, DeepSpeed ZeRO-2/3 DP2, Megatron TP2 / PP2 / EP2 / TP2 x EP2 (Megatron's buffers pad to their alignment).
STATE_TOLERANCE = (0.98, 1.05)
# Activations + logits: the plan counts what fused kernels keep; the CPU engines here run unfused RoPE and attention
# and Megatron's local (non-TE) spec, so they keep more (measured 1.24-1.78), except the transformers engines' RMSNorm
# and SwiGLU (`lean_layers`: SwiGLU keeps 3 intermediate-wide tensors to the plan's 4): 0.96-0.98 measured there.
ACTIVATION_TOLERANCE = (0.9, 2.0)


def register() -> None:
    """Ship this module to Ray workers by value (test helper modules are not importable there)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _SavedPeak:
    """saved_tensors_hooks that keep the live and peak bytes of saved storages (each storage counted once)."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded, self.live, self.now, self.peak = excluded, {}, 0, 0

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in self.excluded or (t.is_leaf and t.requires_grad):  # a weight (ZeRO-3: gathered)
            return t
        count, size = self.live.get(ptr, (0, storage.nbytes()))
        if not count:
            self.now += size
            self.peak = max(self.peak, self.now)
        self.live[ptr] = (count + 1, size)
        return _Held(self, t, ptr)

    def release(self, ptr: int) -> None:
        count, size = self.live[ptr]
        if count == 1:
            del self.live[ptr]
            self.now -= size
        else:
            self.live[ptr] = (count - 1, size)


class _Held:
    """A saved tensor while autograd keeps it; its release when the graph is freed."""

    def __init__(self, tracker: _SavedPeak, t: torch.Tensor, ptr: int) -> None:
        self.tracker, self.t, self.ptr = tracker, t, ptr

    def __del__(self) -> None:
        self.tracker.release(self.ptr)


def _unpack(held: Any) -> torch.Tensor:
    return held.t if isinstance(held, _Held) else held


def _parameters(engine: Any) -> list[torch.Tensor]:
    backend = engine.backend  # Megatron: its model chunks; DeepSpeed: the wrapped module; torch: the model
    modules = getattr(backend, "chunks", None) or [getattr(backend, "module", None) or backend.model]
    return [p for m in modules for p in m.parameters()]


def _stage(engine: Any) -> int:
    if hasattr(engine.backend, "chunks"):
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_rank()
    return 0


def measure_step(engine: Any, batch: Any) -> dict[str, int]:
    """One train step of `engine` on `batch` (this rank's share), measured: {"stage", "params", "state",
    "activations"} (bytes; params: elements of this rank's weights)."""
    params = _parameters(engine)
    excluded = {p.untyped_storage().data_ptr() for p in params}
    peak_state = [0]

    def after_step(*_: Any) -> None:
        peak_state[0] = max(peak_state[0], reachable_tensor_bytes(engine))

    tracker = _SavedPeak(excluded)
    handle = register_optimizer_step_post_hook(after_step)
    try:
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, _unpack):
            engine.train_step(batch)
    finally:
        handle.remove()
    return {
        "stage": _stage(engine),
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in params),  # ZeRO-3: the whole, not the shard
        "state": peak_state[0],
        "activations": tracker.peak,
    }


def measure_group(group: Any, batch: Any, timeout: float = 300) -> list[dict[str, int]]:
    """`measure_step` in every rank of a Ray actor group, each on its data-parallel share of `batch` (as
    `group.dp()` splits it)."""
    import ray

    from rlstages.engines.types import chunk_for_ranks

    chunks = chunk_for_ranks(batch, group.spec.dp)
    refs = [h.__ray_call__.remote(measure_step, chunks[group.spec.coords(r)[0]]) for r, h in enumerate(group.handles)]
    return list(ray.get(refs, timeout=timeout))


def run_config(model_dir: Path, train: Any, batch: Any, extra: tuple[str, ...] = ()) -> Any:
    """configs/tiny.yaml for `model_dir` with `train` as the actor and the batch's shape: prompt / response lengths
    of its padded tensors, its rows as one mini-batch (prompts x n)."""
    from rlstages.configs import load_config
    from rlstages.engines import types as T

    rows = batch[T.PROMPT_IDS].shape[0]
    overrides = [
        f"model.path={model_dir}",
        f"data.max_prompt_length={batch[T.PROMPT_IDS].shape[1]}",
        f"rollout.max_new_tokens={batch[T.RESPONSE_IDS].shape[1]}",
        "rollout.n=4",
        f"data.prompts_per_step={max(1, rows // 4)}",
        f"actor.micro_batch_size={train.micro_batch_size}",  # validated against the mini-batch; then replaced
        *extra,
    ]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    return cfg.model_copy(update={"actor": train})


def planned_rank(model_dir: Path, train: Any, batch: Any, stage: int) -> Any:
    """The plan's actor rank of pipeline stage `stage` for `train` on the tiny model in `model_dir`."""
    import json

    from rlstages.tasks.driver.memory_plan import plan

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    ranks = [r for r in plan(run_config(model_dir, train, batch), hf).ranks if r.role == "actor"]
    return ranks[stage]


def ratios(measured: dict[str, int], rank: Any, train: Any) -> tuple[float, float]:
    """(measured / planned state, measured / planned activations + logits). ZeRO-3's gradient bucket is held from
    start-up on and counted; ZeRO-1/2 free theirs after backward, before the step where the state is measured."""
    g = rank.gpu
    state = g["weights"] + g.get("grads", 0.0) + g.get("optimizer", 0.0)
    if getattr(train, "zero_stage", 0) >= 3:
        state += g.get("buckets", 0.0)
    return measured["state"] / state, measured["activations"] / (g.get("activations", 0.0) + g["logits"])


def check_ranks(model_dir: Path, train: Any, batch: Any, measured: list[dict[str, int]], label: str) -> None:
    """Each rank's measurement against the plan's rank of its stage: the same weight count, state and activations
    within their tolerances (the ratios printed for docs/production.md)."""
    for rank_index, m in enumerate(measured):
        rank = planned_rank(model_dir, train, batch, m["stage"])
        state, acts = ratios(m, rank, train)
        print(f"plan check {label} rank {rank_index} stage {m['stage']}: state {state:.3f}, activations {acts:.3f}")
        # TP keeps norms and biases whole on every rank; the plan splits all dense weights: within 10%
        assert abs(m["params"] / rank.params - 1) <= 0.1, (label, rank_index, m["params"], rank.params)
        assert STATE_TOLERANCE[0] <= state <= STATE_TOLERANCE[1], (label, rank_index, "state", state)
        assert ACTIVATION_TOLERANCE[0] <= acts <= ACTIVATION_TOLERANCE[1], (label, rank_index, "activations", acts)


def check_group(group: Any, model_dir: Path, batch: Any, label: str) -> None:
    """One more train step in every rank of `group` (a Ray actor group of PPOTrainer), measured and checked
    against the plan of its training config (call it last: the step moves the weights)."""
    import time

    register()
    start = time.perf_counter()
    train = group.spec.kwargs["settings"].train.model_copy(update={"num_workers": group.spec.num_workers})
    check_ranks(model_dir, train, batch, measure_group(group, batch), label)
    print(f"plan check {label}: {time.perf_counter() - start:.1f} s")
