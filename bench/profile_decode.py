"""Where one demo-shaped rollout's decode step spends its time on this CPU (issue 53): torch.profiler over one
`generate` (SmolLM2-135M, bf16 weights, 8 prompts x 8 samples, 48 new tokens each, every row decoding all 48),
its self CPU time split into GEMMs, attention, sampling + log-prob, KV-cache bookkeeping, the fp32 weight copy,
and the rest (Python, dispatch, host syncs: wall time not inside any op). Informative: prints shares and
ms per decode step. `python -m bench.profile_decode [fast|compiled|eager]`
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from bench.bench_gen_cpu import NEW, _engine, _rollout

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


def main() -> None:
    """One warm rollout, then one profiled: shares of wall time by op group, and per decode step."""
    torch.set_num_threads(2)
    kind = sys.argv[1] if len(sys.argv) > 1 else "fast"
    engine = _engine(kind)
    _rollout(engine)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        _rollout(engine)
        wall = time.perf_counter() - start
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
    per_step = wall / NEW * 1e3
    print(f"{kind}: one rollout {wall:.2f} s wall, {NEW} decode steps ({per_step:.0f} ms a step, prefill incl.)")
    for group, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {group:32s} {seconds:7.2f} s  {seconds / wall:6.1%}  {seconds / NEW * 1e3:7.1f} ms/step")
    print("top ops by self CPU time:")
    for seconds, key, count in sorted(top, reverse=True)[:14]:
        print(f"  {key:40s} {seconds:7.3f} s  x{count}")


if __name__ == "__main__":
    main()
