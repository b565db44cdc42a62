"""Model registry and providers: a custom registered model runs through rollout and training, in-process
and in a Ray worker (via model.plugins); missing or malformed directories are one-line errors. CPU only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlstages.engines import types as T
from rlstages.engines.models import build_tiny_model, ensure_model, load_causal_lm, read_model_type, registered_models
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams

ASSETS = Path(__file__).resolve().parents[2] / "assets"


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory, monkeypatch_module) -> Path:
    monkeypatch_module.syspath_prepend(str(ASSETS))
    monkeypatch_module.setenv("PYTHONPATH", f"{ASSETS}:{':'.join(sys.path)}")
    import custom_model

    path = tmp_path_factory.mktemp("custom") / "scaled"
    build_tiny_model(path)
    cfg = json.loads((path / "config.json").read_text())
    model = custom_model.ScaledQwen2ForCausalLM(custom_model.ScaledQwen2Config(**{**cfg, "logit_scale": 0.5}))
    model.load_state_dict(load_causal_lm(path).state_dict())
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_custom_model_registered_and_loaded_by_name(custom_dir: Path, tmp_path: Path) -> None:
    assert "scaled_qwen2" in registered_models()
    assert read_model_type(custom_dir) == "scaled_qwen2"
    model = load_causal_lm(custom_dir)
    assert type(model).__name__ == "ScaledQwen2ForCausalLM"
    ids = torch.tensor([[5, 6, 7]])
    plain = load_causal_lm(build_tiny_model(tmp_path / "plain"))  # same seed: the same weights, unscaled
    assert torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits * 0.5, atol=1e-6)


def test_custom_model_runs_rollout_and_training_in_a_ray_worker(custom_dir: Path, ray_session, monkeypatch) -> None:
    from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec

    monkeypatch.setenv("RLSTAGES_PLUGINS", "custom_model")
    spec = GroupSpec(
        name="custom-hybrid",
        engine="rlstages.engines.workers.hybrid:HybridEngine",
        kwargs={
            "trainer": "rlstages.engines.training.core:PPOTrainer",
            "trainer_kwargs": {"settings": TrainerSettings(str(custom_dir))},
            "rollout": "rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
            "rollout_kwargs": {"model_path": str(custom_dir), "dtype": "float32", "apply_chat_template": False},
        },
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ASSETS), os.environ.get("PYTHONPATH")]))},
    )
    group = ActorGroup(spec, "rlstages-tests")
    prompts = [Prompt("a", "1+1=", "2"), Prompt("b", "2+2=", "4")]
    batch = group.dp(120).generate(prompts, SamplingParams(n=2, max_new_tokens=5), 0)
    batch[T.ADVANTAGES] = torch.randn(batch[T.RESPONSE_MASK].shape) * batch[T.RESPONSE_MASK]
    metrics = group.dp(120).train_step(batch)
    assert metrics["logprob_diff"] < 1e-4 and metrics["grad_norm"] > 0
    kind = group.handles[0].__ray_call__.remote(lambda e: type(e.trainer.backend.model).__name__)
    import ray

    assert ray.get(kind) == "ScaledQwen2ForCausalLM"
    group.kill()


def test_missing_and_malformed_directories(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_model_type(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        read_model_type(bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_causal_lm(bad)
    with pytest.raises(ValueError, match="model.provider 'hub' unknown"):
        ensure_model(tmp_path / "new", "hub")


def test_tiny_provider_builds_once(tmp_path: Path) -> None:
    path = ensure_model(
        tmp_path / "m",
        "tiny-random",
        {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64},
    )
    first = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(path, "tiny-random") == path and (path / "model.safetensors").stat().st_mtime_ns == first
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_background_build_is_waited_for_and_its_error_raised(tmp_path: Path) -> None:
    from rlstages.engines.models import start_model_build

    spec = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64}
    assert start_model_build(tmp_path / "m", "tiny-random", spec)
    assert not start_model_build(tmp_path / "m", "tiny-random", spec)  # one build of a directory at a time
    path = ensure_model(tmp_path / "m", "tiny-random")  # waits: the spec is the background build's
    assert read_model_type(path) == "qwen2" and json.loads((path / "config.json").read_text())["hidden_size"] == 32
    assert not start_model_build(path, "tiny-random")  # built: nothing to start
    assert start_model_build(tmp_path / "bad", "no-such-provider")
    with pytest.raises(ValueError, match="model.provider 'no-such-provider' unknown"):
        ensure_model(tmp_path / "bad", "no-such-provider")  # the background thread's error, raised here
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob("*.tmp*"))


def test_gguf_parsed_once_reads_each_file_once_and_restores_gguf(tmp_path: Path) -> None:
    """Inside `gguf_parsed_once` (the demo model's conversion) a GGUF file is parsed once however often
    transformers opens it, and a tensor-name table built once per architecture; after it `gguf` is as before."""
    import gguf

    from rlstages.engines.models.providers import gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", torch.ones(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(str(path)) is first and first.tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))


def test_an_exported_model_loads_back_the_same_and_its_export_imports_no_deepspeed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`save_causal_lm`: the same weights back; transformers' own save imports DeepSpeed, and DeepSpeed MLflow,
    wherever they are installed (as in the test environment), in a worker that trains with plain torch."""
    out = tmp_path / "exported"
    probe = (
        "import sys; from rlstages.engines.models import load_causal_lm, save_causal_lm; "
        f"save_causal_lm(load_causal_lm({str(tiny_model_dir)!r}), {str(out)!r}); "
        "print(sorted({'deepspeed', 'mlflow'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    before, after = load_causal_lm(tiny_model_dir).state_dict(), load_causal_lm(out).state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((out / "config.json").read_text())["model_type"] == read_model_type(tiny_model_dir)
