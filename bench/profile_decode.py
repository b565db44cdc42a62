"""Where one demo-shaped rollout's decode step spends its time on this CPU (issue 53): torch.profiler over
decode steps 4-9 of one `generate` (SmolLM2-135M, bf16 weights, 8 prompts x 8 samples, 48 new tokens each,
every row decoding all 48), their self CPU time split into GEMMs, attention, sampling + log-prob, copies (KV
cache, indexing), host syncs, other ops, and the rest (Python and dispatch: wall time inside no op).
Informative: prints shares and ms per decode step. `python -m bench.profile_decode [fast|compiled|eager]`
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from bench.bench_gen_cpu import THREADS, _engine, _rollout

FIRST, STEPS = 4, 6  # the profiled decode steps (the prefill and the first steps' warm-up left out)

GROUPS = {
    "gemm": ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "mkldnn", "aten::bmm"),
    "sampling": (
        "aten::log_softmax",
        "aten::_log_softmax",
        "aten::exp",
        "aten::cumsum",
        "aten::searchsorted",
        "aten::argmax",
        "aten::gather",
        "aten::rand",
        "aten::uniform_",
        "aten::div",
    ),
    "attention": ("aten::softmax", "aten::_softmax", "aten::masked_fill", "aten::transpose"),
    "copies": (
        "aten::copy_",
        "aten::index",
        "aten::index_put",
        "aten::_to_copy",
        "aten::to",
        "aten::cat",
        "aten::clone",
        "aten::slice",
        "aten::select",
        "aten::view",
        "aten::zeros",
        "aten::fill_",
    ),
    "host sync": ("aten::item", "aten::_local_scalar_dense", "aten::tolist"),
}


class _Done(Exception):
    """The profiled window is over."""


def main() -> None:
    """One rollout with decode steps FIRST .. FIRST + STEPS profiled: shares of their wall time by op group, and
    per decode step (all 64 rows live: every row decodes all 48 tokens)."""
    from rlstages.engines.rollout import slots

    torch.set_num_threads(THREADS)
    kind = sys.argv[1] if len(sys.argv) > 1 else "fast"
    engine = _engine(kind)
    if kind == "compiled":
        _rollout(engine)  # the compilation out of the window
    real_step, count, marks = slots.SlotDecoder.step, [0], {}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def step(self: object, pick: object) -> object:
        count[0] += 1
        if count[0] == FIRST:
            prof.start()
            marks["start"] = time.perf_counter()
        out = real_step(self, pick)  # type: ignore[arg-type]
        if count[0] == FIRST + STEPS - 1:
            marks["stop"] = time.perf_counter()
            prof.stop()
            raise _Done  # the rest of the rollout is not needed
        return out

    slots.SlotDecoder.step = step  # type: ignore[method-assign]
    try:
        _rollout(engine)
    except _Done:
        pass
    finally:
        slots.SlotDecoder.step = real_step  # type: ignore[method-assign]
    wall = marks["stop"] - marks["start"]
    spent: dict[str, float] = defaultdict(float)
    top = []
    for ev in prof.key_averages():
        seconds = ev.self_cpu_time_total / 1e6
        group = next((g for g, names in GROUPS.items() if any(ev.key.startswith(n) for n in names)), "other ops")
        if ev.key.startswith("Torch-Compiled") or ev.key.startswith("## Call CompiledFxGraph"):
            group = "compiled graph (fused)"
        spent[group] += seconds
        top.append((seconds, ev.key, ev.count))
    spent["python/dispatch (outside ops)"] = wall - sum(spent.values())
    print(f"{kind}: {STEPS} decode steps of 64 rows, {wall:.2f} s wall ({wall / STEPS * 1e3:.0f} ms a step)")
    for group, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {group:32s} {seconds:7.2f} s  {seconds / wall:6.1%}  {seconds / STEPS * 1e3:7.1f} ms/step")
    print("top ops by self CPU time:")
    for seconds, key, count in sorted(top, reverse=True)[:14]:
        print(f"  {key:40s} {seconds:7.3f} s  x{count}")


if __name__ == "__main__":
    main()
