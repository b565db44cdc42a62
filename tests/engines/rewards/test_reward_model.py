"""RewardModelEngine on a tiny random Qwen2 sequence classifier built in a tmp dir, in-process and as a Ray actor.

Run: `.venv/bin/pytest tests/engines/rewards/test_reward_model.py -q` (CPU only, no model hub, about 10-20 s).
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import ray
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast, Qwen2Config

from rlstages.engines.rewards.reward_model import RewardModelEngine

torch.set_num_threads(1)

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
PROMPTS = ["What is 2 + 3? Reply with only the number."] * 6
RESPONSES = ["5", "The answer is 5.", "6", "I think it is probably 5, yes", "", "7 7 7 7 7 7 7 7"]


def build_reward_model(path: Path, pad_is_eos: bool, chat_template: bool) -> Path:
    """Save a random 2-layer Qwen2 classifier (hidden 32, one label) and a char-level tokenizer to `path`."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    pad = "<eos>" if pad_is_eos else "<pad>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, eos_token="<eos>", unk_token="<unk>")
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=vocab[pad],
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():  # a random head is tiny; make the scores spread out
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm"), pad_is_eos=False, chat_template=True)


def one_at_a_time(engine: RewardModelEngine) -> list[float]:
    return [engine.score([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES, strict=True)]


def test_scores_are_padding_invariant_and_match_the_hf_head(model_dir: Path) -> None:
    engine = RewardModelEngine(model_dir, micro_batch_size=4)
    right = engine.score(PROMPTS, RESPONSES)
    engine.tokenizer.padding_side = "left"
    left = engine.score(PROMPTS, RESPONSES)
    single = one_at_a_time(engine)
    assert len(right) == len(PROMPTS)
    assert len({round(s, 4) for s in right}) == len(right), "different responses should score differently"
    assert left == pytest.approx(right, abs=1e-5)
    assert single == pytest.approx(right, abs=1e-5)
    # with right padding and pad != eos, HF's own pooling (last non-pad token) must agree
    engine.tokenizer.padding_side = "right"
    texts = [engine._text(p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert texts[0].endswith("<eos>") and texts[0].startswith("<user>")
    enc = engine.tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        hf = engine.model(**enc).logits[:, 0].tolist()
    assert hf == pytest.approx(right, abs=1e-5)


def test_pad_equal_to_eos_without_chat_template(tmp_path: Path) -> None:
    # pad == eos is where reading the score at "the last non-pad id" goes wrong; the mask must decide
    path = build_reward_model(tmp_path / "rm", pad_is_eos=True, chat_template=False)
    engine = RewardModelEngine(path, micro_batch_size=3)
    responses = [r + "<eos>" for r in RESPONSES]
    batched = engine.score(PROMPTS, responses)
    engine.tokenizer.padding_side = "left"
    left = engine.score(PROMPTS, responses)
    single = [engine.score([p], [r])[0] for p, r in zip(PROMPTS, responses, strict=True)]
    assert left == pytest.approx(batched, abs=1e-5)
    assert single == pytest.approx(batched, abs=1e-5)
    assert len({round(s, 4) for s in batched}) == len(batched)
    # HF's own pooling takes the last token != pad id, i.e. the one before the final eos: a different score
    enc = engine.tokenizer([p + r for p, r in zip(PROMPTS, responses, strict=True)], padding=True, return_tensors="pt")
    with torch.no_grad():
        hf = engine.model(**enc).logits[:, 0].tolist()
    assert hf != pytest.approx(batched, abs=1e-3)


def test_missing_or_malformed_directory_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        RewardModelEngine(missing)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="broken") as err:
        RewardModelEngine(broken)
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty has no config.json"):
        RewardModelEngine(empty)


def test_reward_model_as_a_ray_actor(model_dir: Path, ray_session) -> None:
    expected = RewardModelEngine(model_dir, micro_batch_size=4).score(PROMPTS, RESPONSES)
    actor = ray.remote(RewardModelEngine).remote(str(model_dir), micro_batch_size=4, num_threads=1)
    remote = ray.get(actor.score.remote(PROMPTS, RESPONSES), timeout=120)
    assert remote == pytest.approx(expected, abs=1e-6)
    assert len({round(s, 4) for s in remote}) == len(remote)
