"""rlstages vs TRL's GRPOTrainer on the demo (SmolLM2-135M-Instruct, "What is a + b?", reward: last integer),
same hyper-parameters (8 prompts x 8 samples, T=0.7, 48 new tokens, the demo's lr and warm-up then constant,
beta 0, bf16 autocast),
N steps each, one after the other in this run. Each side runs in its own process; this process samples the
peak PSS of that process and all its descendants (Ray's workers included). Figures (ratio = rlstages / TRL):
seconds per step (steps 2..N: step 1 warms up; goal <= 0.15, issue 53's; 0.4 until round 31), peak memory
(goal <= 0.5), generated tokens/s and held-out reward after N steps (the demo's 64 held-out prompts, one sample
each at T=0.7; informative: N is small). Needs the `[bench]` extra (trl).
`BENCH_TRL_STEPS=N python -m bench.bench_trl` (default 3).

On a machine with CUDA both sides run on the GPU (issue 41; goal there: our step at most 0.75 of TRL's): the
rlstages side runs configs/demo_gpu.yaml, TRL trains on `cuda` (`use_cpu=False`, bf16 autocast on the GPU); the
peak memory figure is then the peak GPU memory in use (`mem_get_info`, sampled like the PSS), and the run prints
`our_step/TRL_step` on its own line. `BENCH_TRL_ROLLOUT=vllm` runs our side with the vLLM rollout (colocated in
the hybrid worker, the demo's sampling; issue 55's goal: at most 0.3 of TRL's step, TRL generating with HF as
before); its figures are recorded under names ending in `_vllm`.

TRL's settings (GRPOConfig; trl 1.16 with torch 2.13 and transformers 5.23) and why:
- `use_cpu=True` on a CPU machine: with bf16 and no CUDA, TRL (accelerate) raises a ValueError otherwise
  (`use_cpu=False` on a GPU).
- `bf16` as the demo computes in bf16; TRL keeps fp32 weights under bf16 autocast (it has no stochastic rounding
  of bf16 weights), so its model is loaded in float32. Where our side takes the fp32 kernel for its bf16 layers
  (`actor.fp32_matmul` as `wants_fp32_kernel` resolves it: a CPU whose fp32 GEMM timed clearly faster, e.g. AVX2
  only) TRL runs without autocast (`trl_autocast`): its bf16 GEMMs there are oneDNN's emulation (0.9-20 GFLOP/s on an
  AVX2 EPYC against fp32's ~150), which a TRL user would not choose.
- `num_generations`, `per_device_train_batch_size` = prompts per step x samples, `gradient_accumulation_steps=1`:
  one optimizer step per GRPO step over the same 64 samples as ours.
- `max_completion_length`, `temperature`, `top_k=0`, `top_p=1.0`: the demo's sampling (48 new tokens, T=0.7).
- `learning_rate`, `lr_scheduler_type="constant_with_warmup"`, `warmup_steps`, `max_grad_norm=1.0`: the demo's
  optimizer schedule; TRL's default linear decay would lower the LR step by step and compare unlike runs.
- `beta=0.0` (no reference model, as the demo), `num_iterations=1` (one update per batch), `use_vllm=False`
  (HF generate, as our `hf` rollout); gradient checkpointing is TRL's default and is kept.
- `entropy_coef`, `scale_rewards`, `loss_type` from the demo's `algorithm` (`trl_algorithm`): its entropy bonus
  (the same mean per-token entropy; until round 17 TRL ran without it, a backward less than ours), its std
  normalisation of the group advantages, and its loss aggregation (token-mean is TRL's `dapo`).
- `report_to="none"`, `save_strategy="no"`, `disable_tqdm=True`, `logging_steps=1`: no tracking, checkpoints or
  bars to time; a callback measures each step's wall time.
The held-out reward is measured outside TRL (its model put in eval mode first: left in training mode with the KV
cache off, generating gave garbage after the first token). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import PssSampler, record

if TYPE_CHECKING:
    from rlstages.configs import RunConfig

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / ".cache" / "models" / "smollm2-135m-instruct"


def on_gpu() -> bool:
    """Whether this run compares the two on the GPU (CUDA visible), else on the CPU."""
    import torch

    return torch.cuda.is_available()


VLLM_ROLLOUT = {"backend": "vllm", "gpu_memory_utilization": 0.3, "max_model_len": 512}  # BENCH_TRL_ROLLOUT=vllm


def rollout_backend() -> str:
    """Our side's rollout backend: `hf` (the demo's), or `vllm` with BENCH_TRL_ROLLOUT=vllm."""
    return os.environ.get("BENCH_TRL_ROLLOUT", "hf")


def _rollout_override(path: Path) -> list[str]:
    """With the vLLM rollout: the demo's rollout section replaced by vLLM's with the same sampling."""
    from rlstages.configs.loader import read_yaml

    if rollout_backend() != "vllm":
        return []
    same = {k: v for k, v in read_yaml(path)["rollout"].items() if k in ("n", "temperature", "max_new_tokens", "dtype")}
    return ["rollout=" + json.dumps({**same, **VLLM_ROLLOUT})]


def _demo_config(tmp: Path, steps: int):  # type: ignore[no-untyped-def]
    from rlstages.configs import load_config

    path = ROOT / "configs" / ("demo_gpu.yaml" if on_gpu() else "demo.yaml")
    return load_config(
        path,
        [
            *_rollout_override(path),
            f"model.path={MODEL_DIR}",
            f"trainer.output_dir={tmp}",
            "trainer.run_name=bench-trl",
            f"trainer.total_steps={steps}",
            "trainer.eval_every=0",  # held-out evaluation once, after the last step
            "trainer.eval_at_start=false",
            "checkpoint.every=0",
            f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            "tracking.log_model=false",
        ],
    )


def _walls(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def run_rlstages(steps: int, tmp: Path) -> dict[str, float]:
    """The demo flow for `steps` steps; per-step wall times from MLflow's timestamps of `progress/step`."""
    from rlstages.flows.cli.main import one_malloc_arena  # as `rlstages run` sets it up (on import)

    one_malloc_arena()
    from mlflow import MlflowClient

    from rlstages.flows.train import rl_post_train

    cfg = _demo_config(tmp, steps)
    rl_post_train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'bench-trl'")[0]

    def history(key: str) -> list:  # type: ignore[type-arg]
        return sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)

    stamps = [m.timestamp / 1000 for m in history("progress/step")]
    tokens = [m.value for m in history("rollout/tokens")]
    first = history("timing/step_s")[0].value
    walls = [first, *_walls(stamps)]
    return {
        "step_walls": walls,
        "tokens": tokens,
        "heldout": history("eval/reward_mean")[-1].value,
    }


# our `algorithm.loss_agg_mode` -> TRL's `loss_type` (the ones both have)
TRL_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def trl_autocast(cfg: RunConfig, fp32_kernel: bool) -> bool:
    """Whether TRL trains under bf16 autocast: where the demo computes in bf16 and our side multiplies bf16 natively
    (`fp32_kernel`: it takes the fp32 GEMM here instead, where TRL's fastest setting is fp32 too)."""
    return (cfg.actor.bf16_autocast or cfg.model.dtype == "bfloat16") and not fp32_kernel


def trl_algorithm(cfg: RunConfig) -> dict[str, object]:
    """The GRPOConfig fields that make TRL's objective the config's: entropy bonus, advantage scaling, loss
    aggregation. A loss aggregation TRL has no counterpart for is an error, not a silently different objective."""
    algo = cfg.algorithm
    if algo.loss_agg_mode not in TRL_LOSS:
        raise ValueError(
            f"algorithm.loss_agg_mode={algo.loss_agg_mode!r}: TRL has no such loss; expected one of {sorted(TRL_LOSS)}"
        )
    return {
        "entropy_coef": algo.entropy_coeff,
        "scale_rewards": "group" if algo.norm_adv_by_std else "none",
        "loss_type": TRL_LOSS[algo.loss_agg_mode],
    }


def run_trl(steps: int, tmp: Path) -> dict[str, float]:
    """TRL's GRPOTrainer on the same prompts, reward and held-out evaluation."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlstages.engines.rewards.functions import last_integer
    from rlstages.engines.training.fp32_matmul import wants_fp32_kernel
    from rlstages.tasks.driver.data.loading import eval_prompts, load_rows

    gpu = on_gpu()
    device = "cuda" if gpu else "cpu"
    if not gpu:
        torch.set_num_threads(2)
    cfg = _demo_config(tmp, steps)
    rows = load_rows(cfg.data, "train")
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": row.text}], "answer": row.ground_truth} for row in rows]
    )
    tokens: list[float] = []

    def reward(completions, answer, completion_ids=None, **_):  # type: ignore[no-untyped-def]
        tokens.append(sum(len(c) for c in completion_ids) if completion_ids is not None else float("nan"))
        return [last_integer("", c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

    walls: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            walls.append(time.perf_counter() - self.start)

    r, a = cfg.rollout, cfg.actor
    # TRL trains fp32 weights under bf16 autocast (no stochastic rounding for bf16 weights), where our side's bf16
    # layers take the bf16 GEMM (the same timed choice as the demo's trainer)
    bf16 = trl_autocast(cfg, wants_fp32_kernel(a.fp32_matmul, True, torch.device(device)))
    args = GRPOConfig(
        output_dir=str(tmp / "trl"), use_cpu=not gpu, bf16=bf16, num_generations=r.n,
        per_device_train_batch_size=cfg.data.prompts_per_step * r.n, gradient_accumulation_steps=1,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_k=0, top_p=1.0,
        learning_rate=a.optim.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=a.optim.warmup_steps,
        beta=0.0, num_iterations=1, max_grad_norm=1.0,
        use_vllm=False, logging_steps=1, max_steps=steps, report_to="none", save_strategy="no",
        seed=cfg.trainer.seed, disable_tqdm=True, **trl_algorithm(cfg),
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok, callbacks=[Clock()]
    )
    trainer.train()
    # held-out: the demo's 64 prompts, one sample each at T=0.7, in TRL's (autocast) model as it generates
    prompts = eval_prompts(cfg.data)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True)
             for p in prompts]  # fmt: skip
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(trainer.model.device)
    torch.manual_seed(cfg.trainer.seed)
    # TRL leaves the model in training mode with the KV cache off (gradient checkpointing); generating from it
    # as it was gave garbage after the first token here (held-out 0.0 with a training reward of 0.2-0.4)
    model = trainer.model.eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        out = model.generate(
            **enc, do_sample=True, temperature=r.temperature, top_k=0, top_p=1.0, max_new_tokens=r.max_new_tokens,
            pad_token_id=tok.pad_token_id, use_cache=True,
        )  # fmt: skip
    replies = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = [last_integer("", reply, p.ground_truth) for reply, p in zip(replies, prompts, strict=True)]
    return {"step_walls": walls, "tokens": tokens, "heldout": sum(scores) / len(scores)}


class GpuPeak:
    """Peak GPU memory in use on device 0 (total - free, `mem_get_info`: every process's allocations) above what
    was in use when it started, sampled every `interval` seconds on a background thread."""

    def __init__(self, interval: float = 0.2) -> None:
        import threading

        import torch

        self.interval, self.peak = interval, 0
        self.base = self._used(torch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _used(torch) -> int:  # type: ignore[no-untyped-def]
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    def _run(self) -> None:
        import torch

        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._used(torch) - self.base)

    def __enter__(self) -> GpuPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _side(name: str, steps: int) -> dict[str, float]:
    """Run one side in a fresh process, sampling its tree's PSS (and the GPU's memory in use on a GPU); its
    result is the last stdout line."""
    import contextlib

    from bench.__main__ import bench_env

    env = bench_env()
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "bench.bench_trl", "--side", name, str(steps), out.name]
        with GpuPeak() if on_gpu() else contextlib.nullcontext() as gpu:
            proc = subprocess.Popen(cmd, env=env)
            with PssSampler(proc.pid) as pss:
                code = proc.wait()
        if code:
            raise RuntimeError(f"bench_trl: the {name} side exited with {code}")
        result = json.loads(Path(out.name).read_text())
    result["peak_pss"] = pss.peak
    result["peak_gpu"] = gpu.peak if gpu is not None else 0
    return result


def _summary(name: str, r: dict) -> dict[str, float]:  # type: ignore[type-arg]
    walls = r["step_walls"][1:] or r["step_walls"]  # step 1 warms up (allocations, compilation of kernels)
    toks = r["tokens"][1:] or r["tokens"]
    s = {
        "s_per_step": statistics.mean(walls),
        "tokens_per_s": sum(toks) / sum(walls),
        "peak_gb": r["peak_pss"] / 1e9,
        "peak_gpu_gb": r["peak_gpu"] / 1e9,
        "heldout": r["heldout"],
    }
    print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()) + f"; step walls {r['step_walls']}")
    return s


def main() -> None:
    """Both sides, one after the other; the ratios."""
    if sys.argv[1:2] == ["--side"]:
        name, steps, out = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        with tempfile.TemporaryDirectory(prefix=f"bench-trl-{name}-") as tmp:
            result = (run_rlstages if name == "rlstages" else run_trl)(steps, Path(tmp))
        Path(out).write_text(json.dumps(result))
        return
    steps = int(os.environ.get("BENCH_TRL_STEPS", "3"))
    from rlstages.engines.models import ensure_model

    ensure_model(MODEL_DIR, "smollm2-gguf")
    ours, trl = (_summary(n, _side(n, steps)) for n in ("rlstages", "trl"))
    import torch

    gpu = on_gpu()
    where = f"cuda: {torch.cuda.get_device_name(0)}" if gpu else "cpu"
    vllm = "_vllm" if rollout_backend() == "vllm" else ""
    note = f"{steps} steps, {where}" + (", our rollout vLLM" if vllm else "")
    step_ratio = ours["s_per_step"] / trl["s_per_step"]
    print(f"our_step/TRL_step = {step_ratio:.3f} ({ours['s_per_step']:.2f} s / {trl['s_per_step']:.2f} s, {where})")
    goal = ("<= 0.3" if vllm else "<= 0.75") if gpu else "<= 0.15"  # CPU: issue 53
    record("trl_time_per_step" + ("_gpu" if gpu else "") + vllm, step_ratio, goal,
           f"{ours['s_per_step']:.2f} s vs {trl['s_per_step']:.2f} s per step, {note}")  # fmt: skip
    if gpu:
        record("trl_peak_gpu_memory" + vllm, ours["peak_gpu_gb"] / max(trl["peak_gpu_gb"], 1e-9), None,
               f"peak GPU memory in use {ours['peak_gpu_gb']:.2f} GB vs {trl['peak_gpu_gb']:.2f} GB")  # fmt: skip
    record("trl_peak_memory" + vllm, ours["peak_gb"] / trl["peak_gb"], "<= 0.5",
           f"peak PSS {ours['peak_gb']:.2f} GB vs {trl['peak_gb']:.2f} GB")  # fmt: skip
    record("trl_tokens_per_s" + vllm, ours["tokens_per_s"] / trl["tokens_per_s"], None,
           f"{ours['tokens_per_s']:.0f} vs {trl['tokens_per_s']:.0f} generated tok/s")  # fmt: skip
    record("trl_heldout_reward" + vllm, ours["heldout"] / max(trl["heldout"], 1e-9), None,
           f"held-out {ours['heldout']:.3f} vs {trl['heldout']:.3f} after {note}")  # fmt: skip


if __name__ == "__main__":
    main()
