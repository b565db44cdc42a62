"""On one GPU, each against a baseline measured in the same run (skipped, recording nothing, without CUDA):

- `gpu_update_vs_transformers`: the torch backend's GRPO update (`PPOTrainer.train_step`, bf16 weights, sdpa,
  fused AdamW) on a random-init Qwen2-1.5B-shaped model, 16 rows x 1024 tokens in micro-batches of 4, over
  plain transformers' forward + backward + fused AdamW step on the same shape: plain time / our time, i.e.
  our MFU over theirs (goal >= 1.0). The detail gives both MFUs where the device's peak is known
  (`engines.training.flops`). Also the same with the log-prob pass's eager chunks (`fused_logits.KERNELS` off),
  with transformers' own RMSNorm / SwiGLU / rotary kernels (`fused_layers.KERNELS` off), and with
  BENCH_GPU_PROFILE=DIR the step's top GPU kernels as a table there.
- `gpu_rollout_vs_generate`: the HF rollout engine's generated tokens/s over raw `model.generate`'s on the
  demo's shape (SmolLM2-135M-shaped random bf16 model, sdpa, 64 rows x 48 new tokens, T=0.7; goal >= 0.95).
- `gpu_demo_step_vs_cpu`: one demo step (generate 64 x 48, then the update) on the GPU over the same step on
  this machine's CPU (CPU time / GPU time; informative).

`python -m bench.bench_gpu`. Ran on one H100 on 2026-11-26 (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import MODEL_SHAPES, best_of, record, shape_fields
from rlstages.engines.algorithms import fused_logits
from rlstages.engines.models import fused_layers

ROWS, PROMPT, RESPONSE, MICRO = 16, 512, 512, 4


def random_model(name: str) -> Path:
    """A random-init model of `MODEL_SHAPES[name]` with a character tokenizer, saved once into the temp dir."""
    from rlstages.engines.models import build_tiny_model

    path = Path(tempfile.gettempdir()) / f"rlstages-bench-gpu-{name}"
    if not (path / "config.json").is_file():
        build_tiny_model(
            path, model_type=MODEL_SHAPES[name]["model_type"], max_position_embeddings=4096, **shape_fields(name)
        )
    return path


def grpo_batch(vocab: int, rows: int, prompt: int, response: int) -> Any:
    """Random prompt/response tokens (all real) with GRPO-like advantages, on the CPU as the driver sends them."""
    from tensordict import TensorDict

    from rlstages.engines import types as T

    g = torch.Generator().manual_seed(0)
    width = prompt + response
    return TensorDict(
        {
            T.PROMPT_IDS: torch.randint(0, vocab, (rows, prompt), generator=g),
            T.RESPONSE_IDS: torch.randint(0, vocab, (rows, response), generator=g),
            T.ATTENTION_MASK: torch.ones(rows, width, dtype=torch.long),
            T.POSITION_IDS: torch.arange(width).expand(rows, width).clone(),
            T.RESPONSE_MASK: torch.ones(rows, response),
            T.ADVANTAGES: torch.randn(rows, 1, generator=g).expand(rows, response).clone(),
        },
        batch_size=[rows],
    )


def trainer(path: Path, micro: int) -> Any:
    """The torch backend's actor in bf16 with sdpa on the worker's device."""
    from rlstages.configs.training import OptimConfig, TorchTrainingConfig
    from rlstages.engines.training.core import PPOTrainer
    from rlstages.engines.training.settings import TrainerSettings

    train = TorchTrainingConfig(micro_batch_size=micro, attention="sdpa", optim=OptimConfig(lr=1e-6))
    return PPOTrainer(TrainerSettings(str(path), train=train, dtype="bfloat16"))


def plain_update(path: Path, batch: Any) -> float:
    """Plain transformers on the same shape: forward, log-probs of the response, backward, fused AdamW."""
    from transformers import AutoModelForCausalLM

    from rlstages.engines import types as T

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.cat([batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS]], 1).cuda()
    labels = batch[T.RESPONSE_IDS].cuda()

    def step() -> None:
        for i in range(0, ROWS, MICRO):
            logits = model(input_ids=ids[i : i + MICRO], logits_to_keep=RESPONSE + 1).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, labels[i : i + MICRO, :, None])
            (-logp.mean() * MICRO / ROWS).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return best_of(step)  # the model and its optimizer go with this frame; the caller empties the cache


def update_vs_transformers() -> None:
    from rlstages.engines.training import flops as F

    path = random_model("qwen2-1.5b")
    vocab = MODEL_SHAPES["qwen2-1.5b"]["vocab_size"]
    batch = grpo_batch(vocab, ROWS, PROMPT, RESPONSE)  # on-policy: ratio 1, nothing clipped
    plain = plain_update(path, batch)
    torch.cuda.empty_cache()
    engine = trainer(path, MICRO)
    ours = best_of(lambda: engine.train_step(batch))  # log-prob pass and decoder element-wise work compiled
    eager = without(fused_logits.KERNELS, lambda: best_of(lambda: engine.train_step(batch)))
    unfused = without(fused_layers.KERNELS, lambda: best_of(lambda: engine.train_step(batch)))
    profile_tables(engine, batch)
    name = torch.cuda.get_device_name(0)
    flops = F.step_flops(MODEL_SHAPES["qwen2-1.5b"], [PROMPT + RESPONSE] * ROWS)
    plain_mfu = F.mfu(flops, plain, name, True)

    def detail(label: str, t: float) -> str:
        m = F.mfu(flops, t, name, True)
        mfus = f"; MFU {m:.3f} vs {plain_mfu:.3f}" if m is not None and plain_mfu is not None else ""
        return f"{name}: {label} {t:.3f} s, transformers {plain:.3f} s{mfus}"

    record("gpu_update_vs_transformers", plain / ours, ">= 1.0", detail("ours", ours))
    record("gpu_update_vs_transformers_eager_logits", plain / eager, None, detail("eager log-prob chunks", eager))
    record("gpu_update_vs_transformers_unfused_layers", plain / unfused, None, detail("transformers' norms", unfused))


def without(kernels: Any, timed: Any) -> float:
    """`timed()` with a set of compiled functions (`fused_logits.KERNELS`, `fused_layers.KERNELS`) off, then on."""
    kernels.enabled = False
    try:
        return timed()
    finally:
        kernels.enabled = True


def profile_tables(engine: Any, batch: Any) -> None:
    """With BENCH_GPU_PROFILE=DIR: the 30 kernels that take the most GPU time in one of our update steps, as a
    text table in DIR (what to cut next)."""
    import os

    out = os.environ.get("BENCH_GPU_PROFILE")
    if not out:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.train_step(batch)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "update_profile.txt").write_text(table)


def rollout_vs_generate() -> None:
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
    from rlstages.engines.types import Prompt, SamplingParams

    path = random_model("smollm2-135m")
    engine = HFRolloutEngine(path, dtype="bfloat16", apply_chat_template=False, attention="sdpa")
    prompts = [Prompt(f"p{i}", f"What is {i} + 7? Think, then answer with a number.", str(i + 7)) for i in range(8)]
    sampling = SamplingParams(n=8, temperature=0.7, max_new_tokens=48)
    out: dict[str, Any] = {}

    def ours() -> None:
        out["ours"] = engine.generate(prompts, sampling, seed=0)
        torch.cuda.synchronize()

    ours_s = best_of(ours)
    ours_tokens = float(out["ours"]["response_mask"].sum())
    rows = [engine.tokenizer(p.text)["input_ids"] for p in prompts for _ in range(8)]
    enc = engine.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt").to("cuda")

    def plain() -> None:
        with torch.no_grad():
            gen = engine.model.generate(**enc, do_sample=True, temperature=0.7, max_new_tokens=48, top_k=0)
        out["plain"] = gen[:, enc["input_ids"].shape[1] :]
        torch.cuda.synchronize()

    plain_s = best_of(plain)
    pad = engine.tokenizer.pad_token_id
    plain_tokens = float((out["plain"] != pad).sum())
    ratio = (ours_tokens / ours_s) / (plain_tokens / plain_s)
    detail = f"ours {ours_tokens / ours_s:.0f} tok/s, generate {plain_tokens / plain_s:.0f} tok/s"
    record("gpu_rollout_vs_generate", ratio, ">= 0.95", detail)


def demo_step_vs_cpu() -> None:
    import os

    from rlstages.engines import algorithms as A
    from rlstages.engines import types as T
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
    from rlstages.engines.types import Prompt, SamplingParams

    path = random_model("smollm2-135m")
    prompts = [Prompt(f"p{i}", f"What is {i} + 7?", str(i + 7)) for i in range(8)]
    sampling = SamplingParams(n=8, temperature=0.7, max_new_tokens=48)

    def step_time() -> float:
        rollout = HFRolloutEngine(path, dtype="bfloat16", apply_chat_template=False, attention="sdpa")
        actor = trainer(path, 16)

        def step() -> None:
            batch = rollout.generate(prompts, sampling, seed=0)
            scores = (torch.arange(64) % 3 == 0).float()
            token = A.outcome_to_token_rewards(scores, batch[T.RESPONSE_MASK])
            adv, _ = A.compute_advantages("grpo", token, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid"))
            batch[T.ADVANTAGES] = adv
            actor.train_step(batch)

        return best_of(step, repeat=2)

    gpu = step_time()
    os.environ["RLSTAGES_DEVICE"] = "cpu"
    try:
        cpu = step_time()
    finally:
        del os.environ["RLSTAGES_DEVICE"]
    detail = f"GPU {gpu:.2f} s, CPU ({torch.get_num_threads()} threads) {cpu:.2f} s"
    record("gpu_demo_step_vs_cpu", cpu / gpu, None, detail)


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_gpu: skipped (no CUDA device here); nothing recorded")
        return
    start = time.perf_counter()
    figures = {"rollout": rollout_vs_generate, "demo_step": demo_step_vs_cpu, "update": update_vs_transformers}
    for name in sys.argv[1:] or list(figures):  # `python -m bench.bench_gpu update rollout`: those figures only
        figures[name]()
    print(f"bench_gpu: {time.perf_counter() - start:.0f} s on {torch.cuda.get_device_name(0)}", file=sys.stderr)


if __name__ == "__main__":
    main()
