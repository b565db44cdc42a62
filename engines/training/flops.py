"""Model FLOPs of a training step and the MFU they make on a known GPU (verl's `flops_counter`, reduced).

A dense decoder's step over sequences of lengths s_j costs
    F = 6 * N_dense * sum(s_j) + 6 * sum(s_j^2) * d_head * n_heads * L
with N_dense = L * (3*h*i + h*(q + k + v + o)) + 2*V*h the matmul parameters (gated MLP, attention
projections, embedding and LM head), q = o = n_heads*d_head, k = v = n_kv_heads*d_head. The first term is
forward (2) + backward (4) FLOPs per parameter per token; the second is the attention scores and their
weighted sum (4*s^2*d per head forward, x3 with backward), halved for the causal mask.

MFU = F / seconds / peak. Peaks are bf16 dense tensor-core FLOP/s by device name: a device not in the
table (the CPU, an unlisted GPU) gets no MFU rather than a made-up one, and so does a step that does not
compute in bf16/fp16 (fp32 / TF32 peaks differ).

Non-goals: MoE expert FLOPs, recompute (activation checkpointing re-runs the forward: model FLOPs, not hardware
FLOPs, are counted, as MFU's definition asks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# bf16 dense peak FLOP/s by a substring of `torch.cuda.get_device_name` (first match wins: specific first).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
)


def peak_flops(device_name: str) -> float | None:
    """The device's bf16 dense peak FLOP/s, or None when it is not in `PEAK_BF16_FLOPS` (the CPU too)."""
    for key, peak in PEAK_BF16_FLOPS:
        if key in device_name:
            return peak
    return None


def dense_params(config: Mapping[str, Any]) -> int:
    """N_dense of a decoder from its HF config (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, vocab_size)."""
    h, layers, vocab = int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    d_head = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    q = o = heads * d_head
    k = v = kv_heads * d_head
    return layers * (3 * h * inter + h * (q + k + v + o)) + 2 * vocab * h


def step_flops(config: Mapping[str, Any], seq_lens: Iterable[int], passes: int = 1) -> float:
    """Model FLOPs of forward + backward over sequences of `seq_lens` real tokens, `passes` times (PPO epochs)."""
    lens = [int(s) for s in seq_lens]
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    d_head = int(config.get("head_dim") or h // heads)
    layers = int(config["num_hidden_layers"])
    dense = 6 * dense_params(config) * sum(lens)
    attention = 6 * sum(s * s for s in lens) * d_head * heads * layers
    return float(passes * (dense + attention))


def mfu(flops: float, seconds: float, device_name: str, low_precision: bool) -> float | None:
    """Model FLOPs utilisation of one device, or None where the peak is unknown (or the math is not bf16/fp16)."""
    peak = peak_flops(device_name) if low_precision else None
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak
