"""The fast decode step of the slot decoder for Llama-family models (llama, qwen2, mistral without a sliding
window): its own decode over a static KV cache, in the rollout's compute dtype.

Where the CPU has no native bf16 the bf16 weights are widened to fp32 at every GEMM (oneDNN's bf16 path on an AVX2
or AVX-512F CPU); here they are widened once per generation into an fp32 copy (`RolloutWeights`: 4 bytes a
parameter, 540 MB for SmolLM2-135M, held while generating and freed after), with q/k/v and gate/up concatenated so
that each layer is four GEMMs, packed for oneDNN's fp32 kernel where it is present (`packed_gemm`). The cache is
one preallocated buffer per layer, [slots, kv heads, columns, head dim], right-aligned as `slots.HFStep`'s (every
live row writes its next token at one shared column, a row's padding masked); each row keeps its own position. The
prefill runs the transformers model itself (`decode.prefill`: shared prompts and prefixes once) on the same copies
(a packed fp32 copy's matrices are widened again one module at a time while it runs), and its cache is
copied into the buffers. A model this step cannot decode falls back to the eager step with one line saying why
(`fast_step`).

Non-goal: sliding-window and MoE models, q/k norms (Qwen3), multi-token decode steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rlstages.engines.rollout.decode import left_pad, prefill_distinct, prompt_chunks
from rlstages.engines.rollout.packed_gemm import linear, pack, packing_off

log = logging.getLogger(__name__)

FAST_MODEL_TYPES = ("llama", "qwen2", "mistral")
# distinct prompts prefilled in one forward: the transformers cache of a part sits beside the buffers until copied
PREFILL_PROMPTS = 16


def unsupported(model: Any) -> str | None:
    """Why the fast step cannot decode `model` (None: it can)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in FAST_MODEL_TYPES:
        return f"model_type {kind!r} is not one of {', '.join(FAST_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (silu expected)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind == "mistral"):
        return "a sliding attention window"
    return None


class RolloutWeights:
    """The weights the fast step multiplies, in `dtype`: per layer the fused qkv and gate/up matrices; views of
    them stand in for the transformers model's parameters while it prefills (`swapped`). With `pack` (a CPU
    model whose parameters are all of `dtype`): the four matrices of each layer and the head in oneDNN's blocked
    layout where `packed_gemm.packing_off` allows, the rest the model's own tensors, and no views (the model
    prefills on its own parameters). With `pack` and an fp32 copy of a bf16 model (`widened`): the matrices and
    the head are packed fp32 and not kept plain (the plain copy's memory), the decode looks up the model's own
    embedding rows, and the prefill widens one module's matrices at a time while it runs."""

    def __init__(self, model: Any, dtype: torch.dtype, pack: bool = False) -> None:
        self.dtype = dtype
        self.views: dict[str, torch.Tensor] = {}
        self.layers: list[dict[str, Any]] = []
        params = list(model.parameters())
        self.plain_reason: str | None = None  # why a matrix stayed plain where packing was asked for
        cpu = params[0].device.type == "cpu"
        self.pack = pack and cpu and all(p.dtype == dtype for p in params)
        self.widened = pack and cpu and dtype == torch.float32 and all(p.dtype == torch.bfloat16 for p in params)
        if self.widened:
            self.plain_reason = packing_off(dtype, params[0].device, widened=True)
            self.widened = self.plain_reason is None
        self.packed = 0  # matrices in oneDNN's layout
        inner = model.model
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            prefix = f"model.layers.{i}."
            qkv = self._fuse(prefix + "self_attn.", attn, ("q_proj", "k_proj", "v_proj"))
            gate_up = self._fuse(prefix + "mlp.", mlp, ("gate_proj", "up_proj"))
            self.layers.append(
                {
                    "ln1": self._own(prefix + "input_layernorm.weight", layer.input_layernorm.weight),
                    "ln2": self._own(prefix + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight),
                    "qkv": qkv,
                    "o": self._linear(prefix + "self_attn.o_proj", attn.o_proj),
                    "gate_up": gate_up,
                    "down": self._linear(prefix + "mlp.down_proj", mlp.down_proj),
                }
            )
        self.norm = self._own("model.norm.weight", inner.norm.weight)
        head = model.lm_head.weight
        if self.widened:  # the model's own rows looked up and widened (exact), the head only packed
            self.embed = inner.embed_tokens.weight.detach()
            self.head = self._packed(head.detach().to(dtype))
        else:
            self.embed = self._own("model.embed_tokens.weight", inner.embed_tokens.weight)
            tied = head is inner.embed_tokens.weight or head.data_ptr() == inner.embed_tokens.weight.data_ptr()
            self.head = self._packed(self.embed if tied else self._own("lm_head.weight", head))
        self.eps = float(layer.input_layernorm.variance_epsilon)
        if self.plain_reason is not None:
            log.info("rollout: the decode step's GEMMs are not prepacked (%s)", self.plain_reason)

    def _own(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.pack:  # the model's own tensor, of this dtype
            return tensor.detach()
        copy = tensor.detach().to(self.dtype, copy=True)
        self.views[name] = copy
        return copy

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in oneDNN's layout where packing is asked for and allowed, else as it is."""
        if not (self.pack or self.widened):
            return weight
        reason = packing_off(self.dtype, weight.device, (weight.shape[0], weight.shape[1]), self.widened)
        if reason is not None:
            self.plain_reason = reason
            return weight
        self.packed += 1
        return pack(weight)

    def _linear(self, name: str, module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if module.bias is None else self._own(name + ".bias", module.bias)
        if self.widened:  # no plain copy kept: the prefill widens the model's own matrix
            return self._packed(module.weight.detach().to(self.dtype)), bias
        return self._packed(self._own(name + ".weight", module.weight)), bias

    def _fuse(self, prefix: str, parent: Any, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        mods = [getattr(parent, n) for n in names]
        weight = torch.cat([m.weight.detach().to(self.dtype) for m in mods])
        bias = None
        if mods[0].bias is not None:
            bias = torch.cat([m.bias.detach().to(self.dtype) for m in mods])
        if self.pack or self.widened:
            return self._packed(weight), bias
        start = 0
        for n, m in zip(names, mods, strict=True):
            stop = start + m.weight.shape[0]
            self.views[f"{prefix}{n}.weight"] = weight[start:stop]
            if bias is not None:
                self.views[f"{prefix}{n}.bias"] = bias[start:stop]
            start = stop
        return weight, bias

    @contextlib.contextmanager
    def swapped(self, model: Any) -> Iterator[None]:
        """The model's parameters are these copies inside the block (its own tensors are put back after)."""
        saved = {}
        for name, param in model.named_parameters():
            if name in self.views:
                saved[name] = param.data
                param.data = self.views[name]
        try:
            with self._each_module_widened(model) if self.widened else contextlib.nullcontext():
                yield
        finally:
            for name, param in model.named_parameters():
                if name in saved:
                    param.data = saved[name]

    @contextlib.contextmanager
    def _each_module_widened(self, model: Any) -> Iterator[None]:
        """Inside the block each decoder layer has its matrices in `dtype` while it runs and its own after (a
        widened copy keeps its matrices only packed, which the transformers model cannot read); the embedding
        looks its rows up in its own dtype and widens them (exact), and the head is the packed one the decode
        multiplies: widened whole, each was a transient 113 MB fp32 matrix at every prefill (SmolLM2-135M)."""
        own: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

        def widen(module: torch.nn.Module, args: Any) -> None:
            for param in module.parameters():
                if param.dtype != self.dtype:
                    own.append((param, param.data))
                    param.data = param.data.to(self.dtype)

        def restore(*_: Any) -> None:
            while own:
                param, data = own.pop()
                param.data = data

        hooks = [model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: out.to(self.dtype))]
        for module in model.model.layers:
            hooks += [module.register_forward_pre_hook(widen), module.register_forward_hook(restore)]
        head, model.lm_head = model.lm_head, _PackedHead(self.head)
        try:
            yield
        finally:
            model.lm_head = head
            for hook in hooks:
                hook.remove()
            restore()  # a layer that raised: its matrices go back too


class _PackedHead(torch.nn.Module):
    """The rollout weights' (packed) head standing in for a model's `lm_head` while it prefills."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head(hidden)` on the packed matrix ([..., hidden] -> [..., vocabulary])."""
        return linear(hidden.reshape(-1, hidden.shape[-1]), self.packed).view(*hidden.shape[:-1], -1)


class FastLlamaStep:
    """A `slots.DecodeStep`: the live rows' KV cache in static per-layer buffers, decoded by `_decode`."""

    PACK = True  # its GEMMs on prepacked weights where `packed_gemm` allows (the compiled step takes them plain)

    def __init__(self, model: Any, slots: int, dtype: torch.dtype, columns: int = 256) -> None:
        self.model = model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self.device = next(model.parameters()).device
        self.weights = RolloutWeights(model, dtype, self.PACK)
        self.dtype = dtype
        self.slots = slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._allocate(columns)
        self.valid = torch.zeros(slots, self.columns, dtype=torch.bool, device=self.device)
        self.position = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.n = 0  # live rows: buffer rows [0, n)
        self.start = 0  # the first column a live row may use
        self.column = 0  # where the next fed token of every live row goes

    def _allocate(self, columns: int) -> None:
        shape = (self.slots, self.kv_heads, columns, self.head_dim)
        old_k, old_v = self.keys, self.values
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.model.model.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.model.model.layers]
        for new, old in zip(self.keys + self.values, old_k + old_v, strict=False):  # none the first time
            new[:, :, : old.shape[2]] = old

    @property
    def columns(self) -> int:
        """The buffers' width."""
        return self.keys[0].shape[2]

    def weights_changed(self) -> None:
        """The model's weights changed in place: the copies are taken again."""
        self.weights = RolloutWeights(self.model, self.dtype, self.PACK)

    def prefill(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """The transformers model prefills the rows on the rollout weights, `PREFILL_PROMPTS` distinct prompts at a
        time; their cache joins the buffers one layer at a time (a cache of all 64 of an evaluation's prompts beside
        the buffers was a transient 116 MB in fp32)."""
        if self.n + len(rows) > self.slots:
            raise ValueError(f"prefill: {len(rows)} rows for {self.slots - self.n} free slots")
        ids, mask = left_pad([torch.tensor(list(r), device=self.device) for r in rows], torch.long)
        width, k = mask.shape[1], len(rows)
        if self.n == 0:
            self.start = self.column = 0
        if width > self.column:  # the new rows' prompts are wider than the live rows' history: shift that right
            self._shift(width - self.column)
        self._room(1)
        hi, first = self.column, self.column
        slots = torch.arange(self.n, self.n + k, device=self.device)
        self.valid[slots] = False
        logits: torch.Tensor | None = None
        for part in prompt_chunks(ids, mask, PREFILL_PROMPTS):
            with self.weights.swapped(self.model), torch.inference_mode():  # the buffers below stay normal tensors
                cache, part_logits, part_mask, inverse = prefill_distinct(self.model, ids[part], mask[part])
            lo, at = hi - part_mask.shape[1], slots[part]  # a shared prefix may leave a part narrower: right-aligned
            for i, layer in enumerate(cache.layers):  # each row its prompt's cache
                self.keys[i][at, :, lo:hi] = layer.keys if inverse is None else layer.keys[inverse]
                self.values[i][at, :, lo:hi] = layer.values if inverse is None else layer.values[inverse]
            self.valid[at, lo:hi] = part_mask.bool()
            self.position[at] = part_mask.long().sum(-1)
            if logits is None:
                logits = part_logits.new_empty(k, part_logits.shape[-1])
            logits[part] = part_logits
            first = min(first, lo)
        self.n += k
        self.start = min(self.start, first) if self.n > k else first
        assert logits is not None
        return logits  # the picker widens them to fp32, a chunk of rows at a time (`decode.pick_rows`)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One token per live row at the shared column; the next-token logits [n, V] in the step's dtype (the
        picker widens them to fp32 a chunk of rows at a time: one [n, V] fp32 tensor a step cost a page-faulted
        allocation under jemalloc)."""
        self._room(1)
        with torch.inference_mode():  # no autograd bookkeeping on its ~1,300 small ops; the buffers stay normal
            logits = _decode(self, ids, self.n)
        self.column += 1
        self.position[: self.n] += 1
        return logits

    def select(self, keep: list[int]) -> None:
        """Keep these live rows, moved up to rows [0, len(keep)) in order. Only the rows after the first one that
        left move, and only the cache's columns in use (the others are masked for every live row): a decode
        of 64 rows copied its whole cache at each of its ~24 row departures, 7 % of an evaluation's time."""
        m = len(keep)
        first = next((j for j, i in enumerate(keep) if i != j), m)  # rows before it stay where they are
        if first < m:
            index = torch.tensor(keep[first:], device=self.device)
            lo, hi = self.start, self.column
            for buf in (*self.keys, *self.values):
                buf[first:m, :, lo:hi] = buf[index, :, lo:hi]
            self.valid[first:m] = self.valid[index]
            self.position[first:m] = self.position[index]
        self.n = m
        used = self.valid[:m, self.start : self.column].any(0).nonzero()
        self.start += int(used[0]) if len(used) else 0

    def rewind(self) -> None:
        """Forget the last column (every live row's last fed token)."""
        self.column -= 1
        self.valid[: self.n, self.column] = False
        self.position[: self.n] -= 1

    def clear(self) -> None:
        """No live rows."""
        self.n = self.start = self.column = 0

    def _shift(self, by: int) -> None:
        """Move the live rows' columns right by `by` (room for a wider prefill on their left)."""
        self._room(by + 1)
        lo, hi, n = self.start, self.column, self.n
        for buf in (*self.keys, *self.values):
            buf[:n, :, lo + by : hi + by] = buf[:n, :, lo:hi].clone()
        self.valid[:n, lo + by : hi + by] = self.valid[:n, lo:hi].clone()
        self.valid[:n, lo : lo + by] = False
        self.start, self.column = lo + by, hi + by

    def _room(self, need: int) -> None:
        """At least `need` free columns after `column`: the unused columns on the left are dropped first, then
        the buffers grow."""
        if self.column + need <= self.columns:
            return
        lo, hi, n = self.start, self.column, self.n
        if lo > 0:
            for buf in (*self.keys, *self.values):
                buf[:n, :, : hi - lo] = buf[:n, :, lo:hi].clone()
            self.valid[:n, : hi - lo] = self.valid[:n, lo:hi].clone()
            self.valid[:, hi - lo :] = False
            self.start, self.column = 0, hi - lo
        if self.column + need > self.columns:
            wider = max(self.columns * 3 // 2, self.column + need)
            self._allocate(wider)
            valid = torch.zeros(self.slots, self.columns, dtype=torch.bool, device=self.device)
            valid[:, : self.valid.shape[1]] = self.valid
            self.valid = valid


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of transformers' Llama: the statistics in fp32 (bf16 steps round as the model's own do)."""
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _decode(step: FastLlamaStep, ids: torch.Tensor, n: int) -> torch.Tensor:
    """One decode step of rows [0, n): embed, every layer over the static cache, the head."""
    w = step.weights
    col = step.column
    h, hk, d = step.heads, step.kv_heads, step.head_dim
    x = w.embed[ids].to(step.dtype)  # a widened copy looks up the model's own rows
    pos = step.position[:n]
    cos, sin = step.model.model.rotary_emb(x, pos[:, None])  # [n, 1, d]: the model's own RoPE (its scaling)
    cos, sin = cos.to(step.dtype), sin.to(step.dtype)
    step.valid[:n, col] = True
    # attention over the buffers' full width: a slice of its columns is not one dense batch of matrices, and
    # the batched products copied it (keys and values, every layer: ~10 % of a step); unused columns are masked
    bias = torch.zeros(n, 1, 1, step.columns, dtype=step.dtype, device=x.device)
    bias.masked_fill_(~step.valid[:n, None, None, :], float("-inf"))
    for i, layer in enumerate(w.layers):
        a = _rms(x, layer["ln1"], w.eps)
        qkv = linear(a, *layer["qkv"])
        qk = _rotate(qkv[:, : (h + hk) * d].view(n, h + hk, d), cos, sin)  # queries and keys in one rotation
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + hk) * d :].view(n, hk, d)
        step.keys[i][:n, :, col] = k
        step.values[i][:n, :, col] = v
        keys = step.keys[i][:n]  # [n, hk, columns, d]
        scores = torch.matmul(q.view(n, hk, h // hk, d), keys.transpose(-1, -2)) * step.scale + bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(step.dtype)
        out = torch.matmul(probs, step.values[i][:n])
        x = x + linear(out.reshape(n, h * d), *layer["o"])
        a = _rms(x, layer["ln2"], w.eps)
        gate, up = linear(a, *layer["gate_up"]).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, *layer["down"])
    return linear(_rms(x, w.norm, w.eps), w.head)


def rollout_compute_dtype(weights: torch.dtype, device: torch.device, setting: bool | str = "auto") -> torch.dtype:
    """fp32 for bf16 weights on a CPU whose fp32 GEMM is clearly faster than its bf16 one (`setting` "auto":
    timed once, `training.fp32_matmul.wants_fp32_kernel`; True / False force it), else the weights' dtype."""
    from rlstages.engines.training.fp32_matmul import wants_fp32_kernel

    if weights == torch.bfloat16 and wants_fp32_kernel(setting, True, device):
        return torch.float32
    return weights


def fast_step(
    model: Any, slots: int, dtype: torch.dtype, columns: int = 256, said: set[str] | None = None
) -> FastLlamaStep | None:
    """The fast step for `model` (None where it cannot be built: one line says why, once per `said` set, and
    the eager step decodes)."""
    reason = unsupported(model)
    if reason is None:
        try:
            return FastLlamaStep(model, slots, dtype, columns)
        except Exception as exc:  # noqa: BLE001 - an unforeseen layout: the eager step computes the same
            reason = f"{type(exc).__name__}: {exc}"
    if said is None or reason not in said:
        log.warning("rollout: the fast decode step is off (%s); decoding with the eager transformers step", reason)
    if said is not None:
        said.add(reason)
    return None
