"""The template registry: one declarative template per HF `model_type` (ROLL's `register_template` design).

A template says how an HF config maps onto Megatron-Core config fields and which weight ops turn the HF
tensors into Megatron-Core tensors. Built-in templates, and `get_template` that loads them first, live in
`templates`; a user adds a
model with one `register_template` call in their own module (see docs/new-model.md).
Non-goal: reading files or splitting tensors over ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlstages.engines.convert.ops import WeightOp

TP_KINDS = ("column", "row", "replicated", "vocab")


@dataclass(frozen=True)
class Template:
    """How one HF `model_type` maps onto a Megatron-Core GPTModel (config fields and weight ops)."""

    hf_model_type: str
    config_hf_to_mcore: Mapping[str, str]
    weight_ops: tuple[WeightOp, ...]
    hf_layer_prefix: str
    constant_mcore_config: Mapping[str, Any] = field(default_factory=dict)
    hf_invalid_keys: tuple[str, ...] = ()
    mcore_model_cls: str | None = None
    tp_rules: Mapping[str, str] = field(default_factory=dict)
    module: str | None = None  # where register_template was called; imported again by worker processes
    derive_mcore_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    hf_name_prefixes: Mapping[str, str] = field(default_factory=dict)  # another HF naming -> the ops' naming

    def hf_name(self, name: str) -> str:
        """An HF tensor name in the naming the ops are written for: the first `hf_name_prefixes` prefix it starts
        with is replaced (e.g. a VLM's in-memory `model.language_model.` -> on-disk `model.`)."""
        for other, own in self.hf_name_prefixes.items():
            if name.startswith(other):
                return own + name[len(other) :]
        return name

    def mcore_config(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """Flat Megatron config from an HF config dict: mapped fields, derived fields, then the constants (which
        win)."""
        out: dict[str, Any] = {}
        for hf_key, mcore_key in self.config_hf_to_mcore.items():
            if mcore_key in out:
                continue  # an earlier HF key for the same field won (e.g. rope_parameters.rope_theta)
            value = lookup(hf_config, hf_key)
            if value is not _MISSING:
                out[mcore_key] = value
        if self.derive_mcore_config is not None:
            out.update(self.derive_mcore_config(hf_config))
        out.update(self.constant_mcore_config)
        return out

    def hf_key_for(self, mcore_key: str) -> str:
        """The first HF config key that maps to `mcore_key` (for error messages)."""
        return next((h for h, m in self.config_hf_to_mcore.items() if m == mcore_key), mcore_key)

    def enabled_ops(self, mcore_config: Mapping[str, Any]) -> tuple[WeightOp, ...]:
        """The ops whose `when` flag is set in `mcore_config` (ops without `when` are always on)."""
        return tuple(op for op in self.weight_ops if op.when is None or mcore_config.get(op.when))


_MISSING = object()


def lookup(config: Mapping[str, Any], dotted: str) -> Any:
    """`config["a"]["b"]` for "a.b"; a sentinel when any part is missing or None."""
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            return _MISSING
        value = value[part]
    return value


_TEMPLATES: dict[str, Template] = {}


def register_template(
    hf_model_type: str,
    config_hf_to_mcore: Mapping[str, str],
    weight_ops: Sequence[WeightOp],
    hf_layer_prefix: str,
    constant_mcore_config: Mapping[str, Any] | None = None,
    hf_invalid_keys: Sequence[str] | None = None,
    *,
    mcore_model_cls: str | None = None,
    tp_rules: Mapping[str, str] | None = None,
    derive_mcore_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    hf_name_prefixes: Mapping[str, str] | None = None,
    replace: bool = False,
) -> Template:
    """Register the template of `hf_model_type` (config.json's `model_type`) and return it.

    `mcore_model_cls` ("module:Class") names a GPTModel subclass for custom architectures; `tp_rules` maps
    Megatron name suffixes to "column", "row", "replicated" or "vocab" where the defaults do not know them (a key
    with `*` is a glob over the whole name: `{"vision_model.*": "replicated"}` keeps a custom part whole on every
    TP rank); `derive_mcore_config(hf_config) -> {field: value}` computes the Megatron fields that are not a plain
    rename of one HF key (e.g. MoE routing flags, the dense/MoE layer pattern); `hf_name_prefixes` maps another
    HF naming of the same tensors onto the one the ops use (prefix -> prefix, e.g. a VLM's in-memory names).
    Placement: a tensor outside `decoder.layers.*`, the final norm and the output layer lives on the first
    pipeline stage only (the embedding, and a custom part such as a vision tower).
    """
    if not hf_model_type:
        raise ValueError("register_template: hf_model_type must be config.json's non-empty model_type")
    if hf_model_type in _TEMPLATES and not replace:
        raise ValueError(f"a template for model_type {hf_model_type!r} is already registered; pass replace=True")
    if not hf_layer_prefix.endswith("."):
        raise ValueError(
            f"register_template({hf_model_type!r}): hf_layer_prefix must end with '.', got {hf_layer_prefix!r}"
        )
    bad = {k: v for k, v in (tp_rules or {}).items() if v not in TP_KINDS}
    if bad:
        raise ValueError(f"register_template({hf_model_type!r}): tp_rules values must be one of {TP_KINDS}: {bad}")
    for op in weight_ops:
        if not isinstance(op, WeightOp):
            raise TypeError(f"register_template({hf_model_type!r}): weight_ops must be WeightOp objects, got {op!r}")
    template = Template(
        hf_model_type=hf_model_type,
        config_hf_to_mcore=dict(config_hf_to_mcore),
        weight_ops=tuple(weight_ops),
        hf_layer_prefix=hf_layer_prefix,
        constant_mcore_config=dict(constant_mcore_config or {}),
        hf_invalid_keys=tuple(hf_invalid_keys or ()),
        mcore_model_cls=mcore_model_cls,
        tp_rules=dict(tp_rules or {}),
        module=sys._getframe(1).f_globals.get("__name__"),
        derive_mcore_config=derive_mcore_config,
        hf_name_prefixes=dict(hf_name_prefixes or {}),
    )
    _TEMPLATES[hf_model_type] = template
    return template
