"""Streaming name/layout conversion with completeness accounting, in both directions.

`HfToMcore` takes HF tensors in any order and emits global (unsharded, global-layer) Megatron tensors as
soon as an op has all its inputs; `McoreToHf` does the reverse. Each buffers only the inputs of ops that
are still incomplete (at most about one layer when the input is read in file order). `finish()` raises a
`ConversionError` naming every tensor that no op consumed, every op left without all its inputs, and every
expected output that was never produced.
Non-goal: tensor/pipeline ranks (see `sharding`) and files (see `safetensors_io`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch

from rlstages.engines.convert.ops import Converted, Stack, WeightOp, fill
from rlstages.engines.convert.sharding import EMBEDDING, LAYER_PREFIX, OUTPUT_LAYER, to_local_name, to_te_name
from rlstages.engines.convert.spec import ConversionSpec


class ConversionError(ValueError):
    """A conversion cannot be completed as asked (leftover, missing or mismatched tensors)."""


def listing(names: Iterable[str], limit: int = 8) -> str:
    """`a, b, c ... and N more` for error messages."""
    names = sorted(names)
    head = ", ".join(names[:limit])
    return head + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


class _Stream:
    """Shared machinery: match names to op slots, buffer, run ops, account for what was seen and made."""

    src: str
    dst: str

    def __init__(self, spec: ConversionSpec) -> None:
        self.spec = spec
        self.ops = spec.template.enabled_ops(spec.mcore)
        self.disabled = [op for op in spec.template.weight_ops if op not in self.ops]
        self._pending: dict[tuple[int | None, int, tuple[str, ...]], list[Any]] = {}
        self._unmatched: list[str] = []
        self._produced: set[str] = set()
        self._literal = self._index(self.ops)

    def _prefix(self, side: str) -> str:
        return self.spec.template.hf_layer_prefix if side == "hf" else LAYER_PREFIX

    def _names(self, op: WeightOp, side: str) -> tuple[str, ...]:
        return op.hf_names if side == "hf" else op.mcore_names

    def _index(self, ops: Sequence[WeightOp]) -> dict[tuple[bool, str], tuple[int, int]]:
        table = {}
        for i, op in enumerate(ops):
            if not op.has_wildcard:
                for slot, name in enumerate(self._names(op, self.src)):
                    table[(op.is_layer_op, name)] = (i, slot)
        return table

    def _split(self, name: str) -> tuple[int | None, str]:
        prefix = self._prefix(self.src)
        if name.startswith(prefix):
            index, dot, rest = name[len(prefix) :].partition(".")
            if index.isdigit() and dot:
                return int(index), "." + rest
        return None, name

    def _match(self, layer: int | None, key: str) -> tuple[int, int, tuple[str, ...]] | None:
        hit = self._literal.get((layer is not None, key))
        if hit is not None:
            return (hit[0], hit[1], ()) if self._in_layer_kind(self.ops[hit[0]], layer) else None
        for i, op in enumerate(self.ops):
            if op.has_wildcard and op.is_layer_op == (layer is not None) and self._in_layer_kind(op, layer):
                m = op.match(self.src, key)
                if m is not None:
                    return i, m[0], m[1]
        return None

    def _in_layer_kind(self, op: WeightOp, layer: int | None) -> bool:
        """A dense-only op never matches in an MoE layer and the reverse (so a stray tensor is a leftover)."""
        if op.layers is None or layer is None or not 0 <= layer < self.spec.mcore["num_layers"]:
            return True
        return (op.layers == "moe") == self.spec.is_moe_layer(layer)

    def _skip(self, layer: int | None, key: str, op: WeightOp | None) -> bool:
        return False

    def add(self, name: str, tensor: torch.Tensor) -> Sequence[tuple[str, Converted]]:
        """Take one input tensor; return the outputs it completes (possibly none)."""
        layer, key = self._split(name)
        hit = self._match(layer, key)
        if self._skip(layer, key, None if hit is None else self.ops[hit[0]]):
            return []
        if hit is None:
            self._unmatched.append(name)
            return []
        op_index, slot, wild = hit
        op = self.ops[op_index]
        inputs = self._pending.setdefault((layer, op_index, wild), [None] * len(self._names(op, self.src)))
        if inputs[slot] is not None:
            raise ConversionError(f"{name}: seen twice (duplicate tensor in the input)")
        inputs[slot] = tensor
        if any(t is None for t in inputs):
            return []
        del self._pending[(layer, op_index, wild)]
        try:
            outputs = op.to_mcore(inputs, self.spec.dims) if self.dst == "mcore" else op.to_hf(inputs, self.spec.dims)
        except (ValueError, RuntimeError) as e:  # op messages start with the (layer-local) tensor name
            where = "" if layer is None else f"{self._prefix(self.src)}{layer}"
            raise ConversionError(
                f"{where}{e}" if str(e).startswith(".") else f"{op!r} at {where or 'top'}: {e}"
            ) from e
        names = [self._out_name(layer, fill(n, wild)) for n in self._names(op, self.dst)]
        self._produced.update(names)
        return self._post(list(zip(names, outputs, strict=True)))

    def _out_name(self, layer: int | None, key: str) -> str:
        return key if layer is None else f"{self._prefix(self.dst)}{layer}{key}"

    def _post(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return items

    def expected(self) -> set[str]:
        """Output names that must be produced (non-optional enabled ops; wildcards only when they range over
        the experts of an MoE op)."""
        out: set[str] = set()
        for op in self.ops:
            expert_op = op.has_wildcard and op.layers == "moe"
            if op.optional or (op.has_wildcard and not expert_op):
                continue
            experts = [(str(e),) for e in range(self.spec.num_experts)] if expert_op else [()]
            layers = range(self.spec.mcore["num_layers"]) if op.is_layer_op else [None]
            for layer in layers:
                if not self._in_layer_kind(op, layer):
                    continue
                for name in self._names(op, self.dst):
                    out.update(self._out_name(layer, fill(name, e)) for e in experts)
        return out

    def finish(self, check_expected: bool = True) -> None:
        """Raise a `ConversionError` listing leftovers, incomplete ops and (optionally) missing outputs."""
        problems = []
        if self._unmatched:
            hint = f" (ops disabled by this config: {self.disabled})" if self.disabled else ""
            problems.append(
                f"{len(self._unmatched)} {self.src} tensor(s) not consumed by any op of template "
                f"{self.spec.template.hf_model_type!r}{hint}: {listing(self._unmatched)}"
            )
        missing_inputs = []
        for (layer, op_index, wild), inputs in self._pending.items():
            op = self.ops[op_index]
            names = self._names(op, self.src)
            missing_inputs += [
                self._in_name(layer, fill(n, wild)) for n, t in zip(names, inputs, strict=True) if t is None
            ]
        if missing_inputs:
            problems.append(f"missing {self.src} tensor(s) needed by a partly seen op: {listing(missing_inputs)}")
        not_made = self.expected() - self._produced if check_expected else set()
        if not_made:
            problems.append(f"expected {self.dst} tensor(s) never produced (inputs absent): {listing(not_made)}")
        if problems:
            raise ConversionError("; ".join(problems))

    def _in_name(self, layer: int | None, key: str) -> str:
        return key if layer is None else f"{self._prefix(self.src)}{layer}{key}"


class HfToMcore(_Stream):
    """HF names/layouts -> global Megatron names/layouts (tied embeddings and TE names handled here)."""

    src, dst = "hf", "mcore"

    def add(self, name: str, tensor: torch.Tensor) -> Sequence[tuple[str, Converted]]:
        """Take one HF tensor (either naming of a template with `hf_name_prefixes`); return what it completes."""
        return super().add(self.spec.template.hf_name(name), tensor)

    def _skip(self, layer: int | None, key: str, op: WeightOp | None) -> bool:
        if key in self.spec.template.hf_invalid_keys:
            return True
        if (
            layer is not None
            and layer >= self.spec.mcore["num_layers"]
            and self.spec.hf_config.get("num_nextn_predict_layers")
        ):
            return True  # DeepSeek-V3's multi-token-prediction layers after the last one (HF ignores them too)
        # A tied checkpoint may still carry lm_head: the embedding is the source of truth.
        return self.spec.tied and op is not None and layer is None and OUTPUT_LAYER in op.mcore_names

    def _split_dst(self, name: str) -> tuple[int | None, str]:
        if name.startswith(LAYER_PREFIX):
            index, dot, rest = name[len(LAYER_PREFIX) :].partition(".")
            if index.isdigit() and dot:
                return int(index), "." + rest
        return None, name

    def _post(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = []
        for name, tensor in items:
            if self.spec.transformer_impl == "transformer_engine":
                layer, _ = self._split_dst(name)
                name = to_te_name(
                    name,
                    moe_layer=layer is not None and self.spec.is_moe_layer(layer),
                    mla=bool(self.spec.mcore.get("multi_latent_attention")),
                    grouped_experts=bool(self.spec.mcore.get("moe_grouped_gemm")),
                )
            out.append((name, tensor))
            if name == EMBEDDING and self.spec.tied and self.spec.pp > 1:
                out.append((OUTPUT_LAYER, tensor))  # the last stage keeps its own copy (reference C.2)
        return out

    def expected(self) -> set[str]:
        """Megatron names every conversion of this spec must produce."""
        names = super().expected()
        if self.spec.tied:
            names.discard(OUTPUT_LAYER)
        return names


class McoreToHf(_Stream):
    """Global Megatron names/layouts -> HF names/layouts (TE `_extra_state` and tied output layer skipped)."""

    src, dst = "mcore", "hf"

    def add(self, name: str, tensor: torch.Tensor) -> Sequence[tuple[str, torch.Tensor]]:
        """Take one global Megatron tensor; return the HF tensors it completes."""
        # mcore -> hf runs the ops' `to_hf`, whose outputs are plain tensors (never StackedParts/RowConcat)
        return cast("Sequence[tuple[str, torch.Tensor]]", super().add(to_local_name(name), tensor))

    def stacked_parts(self, name: str) -> int | None:
        """Number of parts when `name` is the output of a `Stack` op (TP shards hold a slice of each part)."""
        layer, key = self._split(to_local_name(name))
        hit = self._match(layer, key)
        op = None if hit is None else self.ops[hit[0]]
        return len(op.hf_names) if isinstance(op, Stack) else None

    def _skip(self, layer: int | None, key: str, op: WeightOp | None) -> bool:
        return key.endswith("._extra_state") or (self.spec.tied and layer is None and key == OUTPUT_LAYER)

    def expected(self) -> set[str]:
        """HF names every export of this spec must produce."""
        names = super().expected()
        if self.spec.tied:
            for op in self.ops:
                if OUTPUT_LAYER in op.mcore_names:
                    names.difference_update(op.hf_names)
        return names
