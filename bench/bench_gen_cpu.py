"""The demo's rollout on this CPU against its compute bound, and what each part of the decode costs (issue 53).

- `gen_compute_fraction` (goal >= 0.5): rollout tokens/s of the HF engine as the demo runs it (SmolLM2-135M,
  bf16 weights, 8 prompts x 8 samples, 48 new tokens each: every row decodes all 48, so the timed work is known;
  the engine's defaults: the fast step on the rollout's weights as `rollout.fp32_weights: auto` chooses) over the
  bound 2N FLOPs a token at the measured GEMM peak of the kernel it multiplies on (fp32 for an fp32 copy).
- `gen_fast_vs_eager` (informative): the same rollout on the eager transformers step over the bf16 weights (the
  decode before issue 53) over the fast step's time.
- `gen_compute_fraction_fast` / `_compiled` (informative): the same fraction with `rollout.decode_step: fast` and
  `compiled` (the fast step's per-token function, sampling included, through torch.compile); `gen_compiled_vs_fast`
  the fast step's time over the compiled one's; `gen_compile_seconds` the first compiled rollout's extra time (the
  compilation, once per engine), with the demo's rollouts it takes to pay it back in the detail.
- `gen_gemm_fraction` (informative): the decode step's GEMMs alone (every layer's four fused matrices and the
  head of the fast step's own rollout weights, prepacked as it multiplies them, streamed from memory as in a
  step) at the demo's 64 rows against the same peak: the ceiling the rest of a step (attention, norms, RoPE, the
  pick) lowers to `gen_compute_fraction`.
- `gen_profile_*` (informative): shares of the fast rollout's time: the fp32 copy of the weights, the prefill,
  the decode steps' forwards, the sampling + log-prob (`pick`), the rest (host bookkeeping).
The detail names the CPU's class (`Machine.cpu_class`). It runs under the rollout workers' allocator (`cluster.heap`'s
default: Ray's jemalloc preloaded; the process starts itself again with it), which the rollout's speed depends on:
before the picker kept its float32 buffers between decode steps, the rollout took up to ~15 % longer there
than under glibc (`decode.PICK_CHUNK_BYTES`).
`python -m bench.bench_gen_cpu`
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from bench.common import matmul_flops, record

ROWS, PROMPTS, NEW = 64, 8, 48
# the demo worker's 2; RLSTAGES_BENCH_THREADS=1 on a machine too loaded for two threads to meet at each barrier
THREADS = int(os.environ.get("RLSTAGES_BENCH_THREADS", "2"))


def _engine(decode_step: str) -> Any:
    from bench.bench_step import MODEL_DIR
    from rlstages.engines.models import ensure_model
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine

    ensure_model(MODEL_DIR, "smollm2-gguf")
    engine = HFRolloutEngine(MODEL_DIR, dtype="bfloat16", batch_size=ROWS, decode_step=decode_step)
    engine.eos_ids = set()  # every row decodes all its tokens: the timed work is known
    return engine


def _rollout(engine: Any) -> float:
    from rlstages.engines.types import Prompt, SamplingParams

    prompts = [Prompt(f"p{i}", f"What is {i % 20 + 1} + {i % 7 + 3}?", "0") for i in range(PROMPTS)]
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(n=ROWS // PROMPTS, temperature=0.7, max_new_tokens=NEW), seed=0)
    return time.perf_counter() - start


def _timed(spent: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return wrapper


HEAP_MARK = "RLSTAGES_BENCH_WORKER_HEAP"  # set once this process runs under the workers' allocator


def _under_the_workers_heap() -> str:
    """The workers' allocator's name (`cluster.heap` default); starts this bench again under it where it is not."""
    from rlstages.engines.runtime.heap import heap_env

    env = heap_env("jemalloc")
    name = "jemalloc" if "LD_PRELOAD" in env else "glibc (no jemalloc in this Ray)"
    if os.environ.get(HEAP_MARK) != "1":
        os.execve(sys.executable, [sys.executable, "-m", "bench.bench_gen_cpu"], {**os.environ, **env, HEAP_MARK: "1"})
    return name


def _gemm_seconds(model: Any, dtype: torch.dtype, rows: int) -> tuple[float, float]:
    """Best of 5 passes of one decode step's GEMMs at `rows` rows over the fast step's own rollout weights
    (`fast_step.RolloutWeights`: each layer's fused matrices and the head, in `dtype`, packed as it packs them),
    so that they stream from memory as in a step. Returns (seconds, FLOPs of one pass)."""
    from rlstages.engines.rollout.fast_step import RolloutWeights
    from rlstages.engines.rollout.packed_gemm import linear

    weights = RolloutWeights(model, dtype, pack=True)
    products = [layer[k] for layer in weights.layers for k in ("qkv", "o", "gate_up", "down")]
    products.append((weights.head, None))
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w, _ in products}
    best = float("inf")
    for _ in range(6):  # the first warms oneDNN's primitives
        start = time.perf_counter()
        for w, bias in products:
            linear(inputs[w.shape[1]], w, bias)
        best = min(best, time.perf_counter() - start)
    return best, 2.0 * rows * sum(w.shape[0] * w.shape[1] for w, _ in products)


def main() -> None:
    """Time the fast, compiled and eager rollouts (best of 2 each, interleaved, after the compiled one's first
    rollout timed against a warm one), then a profiled fast one."""
    from rlstages.engines.rollout import fast_step, hf_rollout, slots
    from rlstages.engines.training.machine import measure

    heap = _under_the_workers_heap()
    torch.set_num_threads(THREADS)
    fast, compiled, eager = _engine("fast"), _engine("compiled"), _engine("eager")
    params = sum(p.numel() for p in fast.model.parameters())
    dtype = fast_step.rollout_compute_dtype(torch.bfloat16, torch.device("cpu"), fast.fp32_weights)
    kernel = "float32" if dtype == torch.float32 else "bfloat16"
    peak = matmul_flops(kernel, n=2048)
    _rollout(fast)  # warm-up (the kernel choice is timed once)
    first_compiled = _rollout(compiled)  # torch.compile's one compilation for this engine
    best = {"fast": float("inf"), "compiled": float("inf"), "eager": float("inf")}
    for _ in range(2):
        for name, engine in (("fast", fast), ("compiled", compiled), ("eager", eager)):
            best[name] = min(best[name], _rollout(engine))
    peak = max(peak, matmul_flops(kernel, n=2048))  # the quieter of two: a shared machine's load passes
    machine = measure("auto", True, 2, "auto")
    bound = peak / (2 * params)
    where = f"{machine.cpu} ({machine.cpu_class}), rollout {machine.rollout or dtype}, heap {heap}"
    default = best["compiled"] if hf_rollout.AUTO_CPU_STEP == "compiled" else best["fast"]
    for name, seconds, goal in (
        ("", default, ">= 0.5"),
        ("_fast", best["fast"], None),
        ("_compiled", best["compiled"], None),
    ):
        tok_s = ROWS * NEW / seconds
        record(
            f"gen_compute_fraction{name}",
            tok_s / bound,
            goal,
            f"{tok_s:.0f} tok/s vs {bound:.0f} (2N FLOPs/token at {peak / 1e9:.0f} GFLOP/s); {where}",
        )
    gemm_s, gemm_flops = _gemm_seconds(fast.model, dtype, ROWS)
    record(
        "gen_gemm_fraction",
        gemm_flops / gemm_s / peak,
        None,
        f"a decode step's GEMMs alone at {ROWS} rows {gemm_s * 1e3:.1f} ms ({kernel}, packed as the fast step's); "
        f"the whole step ~{best['fast'] / NEW * 1e3:.0f} ms; {where}",
    )
    compile_s = first_compiled - best["compiled"]
    saved = best["fast"] - best["compiled"]
    payback = f"pays back after {compile_s / saved:.0f} rollouts like this one" if saved > 0 else "never pays back"
    record(
        "gen_compiled_vs_fast",
        best["fast"] / best["compiled"],
        None,
        f"fast {best['fast']:.1f} s vs compiled {best['compiled']:.1f} s; {where}",
    )
    record("gen_compile_seconds", compile_s, None, f"first compiled rollout {first_compiled:.1f} s; {payback}")
    record(
        "gen_fast_vs_eager",
        best["eager"] / best["fast"],
        None,
        f"eager bf16 step {best['eager']:.1f} s vs fast {best['fast']:.1f} s ({ROWS} x {NEW} tokens); {where}",
    )
    spent: dict[str, float] = defaultdict(float)
    patches = [
        (fast_step, "RolloutWeights", "weights copy"),
        (fast_step.FastLlamaStep, "prefill", "prefill"),
        (fast_step.FastLlamaStep, "forward", "decode forward"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, label in patches:
        setattr(owner, name, _timed(spent, label, getattr(owner, name)))
    real_step = slots.SlotDecoder.step

    def step(self: Any, pick: Any) -> Any:
        return real_step(self, _timed(spent, "pick", pick))

    slots.SlotDecoder.step = step  # type: ignore[method-assign]
    try:
        total = _rollout(fast)
    finally:
        slots.SlotDecoder.step = real_step  # type: ignore[method-assign]
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    spent["rest"] = total - sum(spent.values())
    for label, seconds in spent.items():
        record(f"gen_profile_{label.replace(' ', '_')}", seconds / total, None, f"{seconds:.2f} s of {total:.2f} s")


if __name__ == "__main__":
    main()
