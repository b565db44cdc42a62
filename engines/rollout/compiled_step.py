"""The compiled decode step of the slot decoder (`rollout.decode_step: compiled`): the fast step's per-token
function (`fast_step._decode`, Llama / Qwen2 / Mistral) written as one pure function of static shapes and
compiled by `torch.compile` (inductor's C++ code on CPU, the same function on CUDA), with the sampling and the
chosen token's log-prob inside it.

Shapes are static but for the live rows: the KV cache is one buffer [2, layers, slots, kv heads, columns, head
dim] whose width is rounded up to `COLUMN_BUCKET` (a generation's prompts rarely change the bucket), and the rows
dimension is marked dynamic (at least two rows are fed: dynamo specialises a dimension of 1), so one graph serves
every step of every generation. The function reads the cache and returns the new token's keys and values (it
mutates nothing: no copy-back of its inputs); the step writes them at the shared column with one indexed copy.
The uniforms of the inverse-CDF draw are drawn outside (`torch.rand`, one per live row in order, as
`sampling.sample_logprobs` draws them), so the same seed draws the same tokens as the eager step up to rounding.
Temperature and greedy are tensors: training and greedy evaluation share the graph. The one host read per token
is the slot decoder's (tokens and log-probs together, for the finished-row check).

The weights are arguments, not captured constants: a weight update (the fast step's fp32 copy taken again, or
the same tensors copied into in place) reuses the compiled code. `CompiledDecode` is held per engine; where it
cannot be built (no C++ compiler, a compile error) the step decodes with the fast eager function, said once.

Non-goal: CUDA graphs (`mode="reduce-overhead"`); paged attention; top-k / top-p inside the graph (those picks
run eagerly on the returned logits).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rlstages.engines.rollout.fast_step import FastLlamaStep, _rms, _rotate
from rlstages.engines.tensordict_import import register_with_dynamo

log = logging.getLogger(__name__)

COLUMN_BUCKET = 64  # the cache's width is a multiple of this: one graph for every prompt length in a bucket


def _bucket(columns: int) -> int:
    return -(-columns // COLUMN_BUCKET) * COLUMN_BUCKET


def decode_tokens(
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    noise: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    valid: torch.Tensor,
    kv: torch.Tensor,
    params: list[torch.Tensor],
    spec: tuple[int, int, int, float, bool],
) -> tuple[torch.Tensor, ...]:
    """One token for rows [0, B) (B = len(ids)) over the cache `kv` (not written): the next-token logits [B, V]
    (fp32), the picked ids and their log-probs under softmax(logits / temperature) (argmax where `greedy`, else
    the inverse CDF at `noise`), and the fed token's keys and values [layers, B, kv heads, head dim]."""
    h, hk, d, eps, has_bias = spec
    b = ids.shape[0]
    scale = d**-0.5
    per = 7 if has_bias else 6
    layers = (len(params) - 3) // per
    embed, norm, head = params[-3:]
    x = embed[ids]
    bias = torch.zeros_like(valid[:b], dtype=x.dtype).masked_fill(~valid[:b], float("-inf"))[:, None, None, :]
    keys, values = [], []
    for i in range(layers):
        p = params[i * per : (i + 1) * per]
        ln1, ln2, w_qkv, w_o, w_gate_up, w_down = p[0], p[1], p[2], p[3], p[4], p[5]
        b_qkv = p[6] if has_bias else None
        a = _rms(x, ln1, eps)
        qkv = F.linear(a, w_qkv, b_qkv)
        q = qkv[:, : h * d].view(b, hk, h // hk, d)
        k = qkv[:, h * d : (h + hk) * d].view(b, hk, d)
        v = qkv[:, (h + hk) * d :].view(b, hk, d)
        q = _rotate(q, cos[:, None, None, :], sin[:, None, None, :])
        k = _rotate(k, cos[:, None, :], sin[:, None, :])
        cached_k, cached_v = kv[0, i, :b], kv[1, i, :b]  # [B, hk, W, d]
        scores = torch.matmul(q, cached_k.transpose(-1, -2)) * scale + bias  # [B, hk, g, W]
        own = (q * k[:, :, None, :]).sum(-1, keepdim=True) * scale  # the fed token attends to itself
        probs = torch.softmax(torch.cat([scores, own], -1), dim=-1, dtype=torch.float32).to(x.dtype)
        out = torch.matmul(probs[..., :-1], cached_v) + probs[..., -1:] * v[:, :, None, :]
        x = x + F.linear(out.reshape(b, h * d), w_o)
        gate, up = F.linear(_rms(x, ln2, eps), w_gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, w_down)
        keys.append(k)
        values.append(v)
    logits = F.linear(_rms(x, norm, eps), head).float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    best = logprobs.argmax(-1)
    cdf = logprobs.exp().cumsum(-1)
    # searchsorted(right=True) as a count: a reduction inductor fuses, with the rows dimension kept symbolic
    drawn = (cdf <= (noise * cdf[:, -1])[:, None]).sum(-1).clamp(max=cdf.shape[-1] - 1)
    impossible = logprobs.gather(-1, drawn[:, None])[:, 0] == float("-inf")
    picked = torch.where(greedy | impossible, best, drawn)
    return logits, picked, logprobs.gather(-1, picked[:, None])[:, 0], torch.stack(keys), torch.stack(values)


def _flat(step: FastLlamaStep) -> list[torch.Tensor]:
    """The rollout weights in `decode_tokens`' order (per layer: norms, fused matrices, the qkv bias if any)."""
    w = step.weights
    out: list[torch.Tensor] = []
    for layer in w.layers:
        out += [layer["ln1"], layer["ln2"], layer["qkv"][0], layer["o"][0], layer["gate_up"][0], layer["down"][0]]
        biases = [layer["qkv"][1], layer["o"][1], layer["gate_up"][1], layer["down"][1]]
        if any(t is not None for t in biases[1:]):
            raise ValueError("a bias on o/gate/up/down (only q/k/v biases are compiled)")
        if biases[0] is not None:
            out.append(biases[0])
    return [*out, w.embed, w.norm, w.head]


class CompiledDecode:
    """One engine's compiled `decode_tokens` (built on first use, kept across generations and weight updates);
    `off`: why it is not used (None while it is), said once."""

    def __init__(self) -> None:
        self.fn: Any = None
        self.off: str | None = None if has_compiler() else "no C++ compiler (g++, c++ or clang++) on PATH"
        self.said = False

    def fail(self, reason: str) -> None:
        """Stop compiling for this engine and say why, once."""
        self.off = reason
        self.say()

    def say(self) -> None:
        """The one line saying the compiled step is off (logged once per engine)."""
        if self.off is not None and not self.said:
            self.said = True
            log.warning("rollout: the compiled decode step is off (%s); decoding with the fast eager step", self.off)

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        """`decode_tokens(*args)` compiled (torch.compile on the first call; dynamo's cache after)."""
        if self.fn is None:
            register_with_dynamo()
            self.fn = torch.compile(decode_tokens, dynamic=False, fullgraph=True)
        return self.fn(*args)


def has_compiler() -> bool:
    """Whether a C++ compiler for inductor's CPU code is on PATH."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


class CompiledLlamaStep(FastLlamaStep):
    """The fast step with its per-token function compiled (`CompiledDecode`); `forward_pick` samples inside it."""

    kv: torch.Tensor  # [2, layers, slots, kv heads, width, head dim]: `keys` / `values` view it
    PACK = False  # inductor takes the weights as plain tensors (its own freezing packs what it compiles)
    # its compiled kernel outlives the call: inference tensors would be other inputs to dynamo's guards than a
    # streaming decoder's (a recompilation), so a generate call does not enter inference mode for it
    CALL_SCOPED = False

    def __init__(self, model: Any, slots: int, dtype: torch.dtype, columns: int, kernel: CompiledDecode) -> None:
        self.kernel = kernel
        super().__init__(model, slots, dtype, columns)
        self.params = _flat(self)
        has_bias = self.weights.layers[0]["qkv"][1] is not None
        self.spec = (self.heads, self.kv_heads, self.head_dim, self.weights.eps, has_bias)

    def _allocate(self, columns: int) -> None:
        """One [2, layers, slots, kv heads, width, head dim] buffer (width bucketed); `keys` / `values` view it."""
        layers = len(self.model.model.layers)
        shape = (2, layers, self.slots, self.kv_heads, _bucket(columns), self.head_dim)
        kv: torch.Tensor = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.keys:
            kv[..., : self.columns, :] = self.kv
        self.kv = kv
        self.keys, self.values = list(kv[0].unbind(0)), list(kv[1].unbind(0))

    def weights_changed(self) -> None:
        """The weights are taken again; the compiled code is reused (they are its arguments)."""
        super().weights_changed()
        self.params = _flat(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One token per live row; the next-token logits [n, V] in fp32."""
        out = self._step(ids, None)
        return out[0] if out is not None else super().forward(ids)

    def forward_pick(self, ids: torch.Tensor, fused: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One token per live row, and the next token of each picked inside the compiled step (`fused`:
        `decode.FusedPick`); None where the pick must run eagerly (the caller then calls `forward`)."""
        if fused is None or self.kernel.off is not None:
            return None
        out = self._step(ids, fused)
        return None if out is None else (out[1], out[2])

    def _step(self, ids: torch.Tensor, fused: Any) -> Sequence[torch.Tensor] | None:
        if self.kernel.off is not None:
            self.kernel.say()
            return None
        self._room(1)
        n, col = self.n, self.column
        rows = min(max(n, 2), self.slots)
        fed = torch.zeros(rows, dtype=torch.long, device=self.device)
        fed[:n] = ids
        position = self.position[:rows]
        cos, sin = self.model.model.rotary_emb(self.weights.embed[:1], position[:, None])
        noise = torch.zeros(rows, dtype=torch.float32, device=self.device)
        greedy = fused is None or fused.greedy
        if not greedy:
            noise[:n] = torch.rand(n, dtype=torch.float32, device=self.device)
        self.valid[:rows, col] = False
        args = (fed, cos[:, 0].to(self.dtype), sin[:, 0].to(self.dtype), noise)
        if rows > 1:
            for t in args:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        temperature = torch.tensor(1.0 if fused is None else fused.scale, device=self.device)
        flag = torch.tensor(greedy, device=self.device)
        try:
            out = self.kernel(*args, temperature, flag, self.valid, self.kv, self.params, self.spec)
        except Exception as exc:  # noqa: BLE001 - a compile error: the fast eager step computes the same
            self.kernel.fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        logits, picked, logprobs, keys, values = out
        self.kv[0, :, :rows, :, col] = keys
        self.kv[1, :, :rows, :, col] = values
        self.valid[:n, col] = True
        self.column += 1
        self.position[:n] += 1
        return logits[:n], picked[:n], logprobs[:n]


def compiled_step(
    model: Any, slots: int, dtype: torch.dtype, columns: int, kernel: CompiledDecode
) -> CompiledLlamaStep | None:
    """The compiled step for `model`, or None where the fast step itself does not apply (the caller says why)."""
    if kernel.off is not None:
        kernel.say()
    try:
        return CompiledLlamaStep(model, slots, dtype, columns, kernel)
    except Exception as exc:  # noqa: BLE001 - an unforeseen layout: the fast eager step computes the same
        kernel.fail(f"{type(exc).__name__}: {exc}")
        return None
