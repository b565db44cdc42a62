"""LoRA for the actor with the `peft` library: wrap a causal LM, read merged weights, save/load the adapter.

The frozen base weights stay in the model exactly once: the reference policy is the same model with the
adapter disabled (`adapter_disabled`), rollout engines get merged weights `W + scale * B @ A` computed per
layer without touching the model (`named_weights`), checkpoints hold only the trainable adapter tensors
(`trainable_state` / `load_trainable_state`), and an export writes the merged HF model plus the adapter
(`save_pretrained`). Every function also takes a plain model (no LoRA) and then does the ordinary thing, so
a trainer calls them unconditionally.

Non-goals: QLoRA / quantised bases, several adapters at once, rollout engines that take adapters natively.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from rlstages.engines.models.registry import save_causal_lm

ADAPTER_DIR = "adapter"


@dataclass(frozen=True)
class LoraParams:
    """What to adapt and how: rank, alpha (scale = alpha / rank), dropout and the target module names."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_lora(model: Any) -> bool:
    """True for a model wrapped by `wrap_lora`."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def wrap_lora(model: Any, params: LoraParams | dict[str, Any]) -> Any:
    """The model with LoRA adapters on `target_modules`; only the adapter is trainable (base frozen)."""
    from peft import LoraConfig, get_peft_model

    p = params if isinstance(params, LoraParams) else LoraParams(**params)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in p.target_modules if t not in linear]
    if missing:
        some = ", ".join(sorted(linear))
        raise ValueError(f"model.lora.target_modules {missing} are not linear layers of this model (it has {some})")
    config = LoraConfig(
        r=p.rank,
        lora_alpha=p.alpha,  # type: ignore[arg-type]  # peft annotates int; the scale alpha / r takes a float
        lora_dropout=p.dropout,
        target_modules=list(p.target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )
    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()  # checkpointed blocks need a grad-carrying input with a frozen base
    return get_peft_model(model, config)


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters an optimizer should hold (the adapter's, under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_disabled(model: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which the model is its frozen base (the reference policy); a no-op without LoRA."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def forward_as(model: Any, base: bool) -> Iterator[None]:
    """Forward passes as the adapted policy or (`base`) the frozen reference. Under LoRA the two share one
    model, so concurrent callers in one process (in-process workers) take turns; a no-op without LoRA."""
    if not is_lora(model):
        yield
        return
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(model, threading.Lock())
    with lock, adapter_disabled(model) if base else contextlib.nullcontext():
        yield


def _hf_name(peft_key: str) -> str:
    """`base_model.model.X.base_layer.weight` -> `X.weight` (the base model's own HF name)."""
    key = peft_key.removeprefix("base_model.model.")
    return key.replace(".base_layer.", ".")


def named_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named weights as the rollout engines need them: merged `W + scale * B @ A` under LoRA (computed per
    layer; the model is not modified), the state dict otherwise."""
    if not is_lora(model):
        for name, tensor in model.state_dict().items():
            yield name, tensor.detach()
        return
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, LoraLayer] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            deltas[_hf_name(f"{name}.weight")] = module
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if ".lora_" in key:
                continue
            name = _hf_name(key)
            layer = deltas.get(name)
            if layer is None:
                yield name, tensor.detach()
                continue
            # peft defines get_delta_weight on the concrete LoRA layers (Linear, Embedding, ...), not the mixin
            parts = (layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)  # type: ignore[attr-defined]
            delta = cast(torch.Tensor, sum(parts))
            yield name, (tensor + delta.to(tensor.dtype)).detach()


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """What a checkpoint holds: the adapter tensors under LoRA (the base is the model path), else everything."""
    if not is_lora(model):
        return dict(model.state_dict())
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_trainable_state(model: Any, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load what `trainable_state` returned: (missing, unexpected) keys, as `load_state_dict` reports them."""
    if not is_lora(model):
        result = model.load_state_dict(state, strict=False)
        return list(result.missing_keys), list(result.unexpected_keys)
    from peft import set_peft_model_state_dict

    expected = set(trainable_state(model))
    result = set_peft_model_state_dict(model, state)
    missing = sorted(expected - set(state))
    return missing, list(result.unexpected_keys)  # type: ignore[attr-defined]  # peft: an untyped namedtuple


def save_pretrained(model: Any, path: Path) -> None:
    """An HF directory of the model; under LoRA the merged weights (what the policy is), and the adapter alone
    in `path/adapter` (peft's format, loadable with `PeftModel.from_pretrained(base, path/adapter)`)."""
    path = Path(path)
    if not is_lora(model):
        save_causal_lm(model, path)
        return
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, tensor in named_weights(model):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen and name.endswith("lm_head.weight"):  # tied embeddings: saved once, as HF does
            continue
        seen[ptr] = name
        merged[name] = tensor.contiguous().clone()
    if getattr(base.config, "tie_word_embeddings", False):
        merged.pop("lm_head.weight", None)
    save_file(merged, str(path / "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(str(path))
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(path))
    model.save_pretrained(str(path / ADAPTER_DIR), safe_serialization=True)
