"""The fast decode step of the slot decoder for Llama-family models (llama, qwen2, mistral without a sliding
window): its own decode over a static KV cache, in the rollout's compute dtype.

Where the CPU has no native bf16 the bf16 weights are widened to fp32 at every GEMM (oneDNN's bf16 path on an AVX2
or AVX-512F CPU); here they are widened once per generation into an fp32 copy (`rollout_weights.RolloutWeights`: 4
bytes a parameter, 540 MB for SmolLM2-135M, held while generating and freed after), with q/k/v and gate/up
concatenated so that each layer is four GEMMs, packed for oneDNN's fp32 kernel where it is present (`packed_gemm`).
The cache is one preallocated buffer per layer, [slots, kv heads, columns, head dim], right-aligned as
`slots.HFStep`'s (every live row writes its next token at one shared column, a row's padding masked); each row keeps
its own position. The prefill runs the transformers model itself (`decode.prefill`: shared prompts and prefixes
once) on the same copies (a packed fp32 copy's matrices are widened again one module at a time while it runs), and
its cache is copied into the buffers. A model this step cannot decode falls back to the eager step with one line
saying why (`fast_step`).

Non-goal: sliding-window and MoE models, q/k norms (Qwen3), multi-token decode steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rlstages.engines.rollout.decode import left_pad, prefill_distinct, prompt_chunks
from rlstages.engines.rollout.packed_gemm import linear
from rlstages.engines.rollout.rollout_weights import RolloutWeights

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


class FastLlamaStep:
    """A `slots.DecodeStep`: the live rows' KV cache in static per-layer buffers, decoded by `_decode`."""

    PACK = True  # its GEMMs on prepacked weights where `packed_gemm` allows (the compiled step takes them plain)
    CALL_SCOPED = True  # buffers and weight copies end with the generate call (`slots.DecodeStep`)

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
        heads: dict[tuple[int, ...], Any] = {}  # the prefix all prompts share (a chat template's) forwarded once
        for part in prompt_chunks(ids, mask, PREFILL_PROMPTS):
            with self.weights.swapped(self.model), torch.inference_mode():  # the buffers below stay normal tensors
                cache, part_logits, part_mask, inverse = prefill_distinct(self.model, ids[part], mask[part], heads)
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


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sines with rotate_half's minus moved onto their first half, for `_rotate_rolled` (made once a step)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotate_rolled(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`_rotate(x, cos, sin)` bit for bit given `_signed_sin(sin)` (a sign moves from one factor to the other), in
    four ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _decode(step: FastLlamaStep, ids: torch.Tensor, n: int) -> torch.Tensor:
    """One decode step of rows [0, n): embed, every layer over the static cache, the head."""
    w = step.weights
    col = step.column
    h, hk, d = step.heads, step.kv_heads, step.head_dim
    x = w.embed[ids].to(step.dtype)  # a widened copy looks up the model's own rows
    pos = step.position[:n]
    cos, sin = step.model.model.rotary_emb(x, pos[:, None])  # [n, 1, d]: the model's own RoPE (its scaling)
    cos, sin = cos.to(step.dtype), _signed_sin(sin.to(step.dtype))
    step.valid[:n, col] = True
    # attention over the buffers' full width: a slice of its columns is not one dense batch of matrices, and
    # the batched products copied it (keys and values, every layer: ~10 % of a step); unused columns are masked
    bias = torch.zeros(n, 1, 1, step.columns, dtype=step.dtype, device=x.device)
    bias.masked_fill_(~step.valid[:n, None, None, :], float("-inf"))
    for i, layer in enumerate(w.layers):
        a = _rms(x, layer["ln1"], w.eps)
        qkv = linear(a, *layer["qkv"])
        qk = _rotate_rolled(qkv[:, : (h + hk) * d].view(n, h + hk, d), cos, sin)  # queries and keys in one rotation
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
