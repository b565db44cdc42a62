"""The fast decode step's GEMMs on weights prepacked once per generation into oneDNN's blocked layout (CPU).

A plain bf16 `F.linear` on the CPU goes through oneDNN, which reorders the weight into its blocked layout at every
call: at a decode step's few rows that reorder costs about as much as the product. Packed once (the rollout's
per-generation copy of the weights is made anyway), the same kernel reads them as they are. Measured on an AMX
Xeon, 2 threads, SmolLM2-135M's shapes: 1.3-1.4x at 64 rows, 1.6-2.0x at 1-7 rows (the long replies' tail), the
49k-row head 1.9x; bit-identical to `F.linear` (the same kernel), which `packing_off` checks at the model's shape
before the first use.

An fp32 copy of a bf16 model's weights (a CPU without native bf16) is packed for oneDNN's fp32 kernel instead of
multiplied by MKL's sgemm, which repacks each weight at every call: the demo's 30 layers and head streamed at 64
rows ran 1.1x faster packed on an AVX2 EPYC (0.69 of the GEMM peak against 0.63), 1.5x at 16 rows and 2.8x on
the head at 4 rows. Its sums are taken in another order than MKL's, so it agrees with `F.linear` to fp32
rounding, not bit for bit (checked, `packing_off`); a model's own fp32 weights stay on `F.linear`, whose decode
is transformers' own bit for bit. A wide plain fp32 product (the 49k-vocabulary head of an fp32 model) is split
into blocks of `WIDE_BLOCK` output features: MKL's sgemm on the whole [49152 x 576] weight ran at 0.36-0.42 of
the GEMM peak at 64 rows on an AVX2 EPYC, in blocks at 0.63 (1.5x), with the same sums, which the first call of
each shape checks (`linear`; else the plain product, with one line). MKL's own packed sgemm
(`mkl._mkl_linear`) measured no faster.

Non-goal: packing for the update (its weights change at every optimizer step) or on GPUs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ROWS_HINT = 64  # the decode batch oneDNN picks the blocking for; every row count works (measured 1-640)
WIDE_BLOCK = 2048  # output features per GEMM of a wide fp32 product (1024-3072 measured alike, 8192 slower)
FP32_RTOL = 1e-5  # a packed fp32 product's distance from F.linear's, relative to its largest value
_checked: dict[tuple[torch.dtype, int, int], str | None] = {}
_blocks_match: dict[tuple[int, int], bool] = {}  # per wide fp32 weight shape: blocked product == F.linear's


def packing_off(
    dtype: torch.dtype, device: torch.device, shape: tuple[int, int] = (64, 64), widened: bool = False
) -> str | None:
    """Why weights of `dtype` [out, in] = `shape` on `device` are multiplied plain (None: packed): a CPU, oneDNN's
    ops for the dtype present, and a packed product bit-identical to `F.linear` for bf16, within fp32 rounding of
    it for an fp32 copy of a bf16 model (`widened`; a model's own fp32 weights stay plain), checked once per shape."""
    if device.type != "cpu":
        return f"{device.type} device"
    if dtype == torch.float32 and not widened:
        return "the model's own float32 weights (bf16 and a widened fp32 copy are packed)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} weights (bf16 and a widened fp32 copy are packed)"
    try:
        supported = torch.backends.mkldnn.is_available()
        if dtype == torch.bfloat16:
            supported = supported and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch build without these private ops
        supported = False
    if not supported:
        return f"no oneDNN {str(dtype).removeprefix('torch.')} support in this torch or CPU"
    key = (dtype, *shape)
    if key not in _checked:
        _checked[key] = _mismatch(dtype, shape)
    return _checked[key]


def _mismatch(dtype: torch.dtype, shape: tuple[int, int]) -> str | None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).to(dtype)
    rows = torch.randn(7, shape[1], generator=gen).to(dtype)
    try:
        packed = linear(rows, pack(weight))
    except (AttributeError, RuntimeError) as exc:
        return f"oneDNN's packed linear failed: {str(exc).splitlines()[0]}"
    plain = F.linear(rows, weight)
    if dtype == torch.float32:
        close = bool((packed - plain).abs().max() <= FP32_RTOL * plain.abs().max())
        return None if close else "the packed fp32 product is farther from F.linear's than fp32 rounding"
    return None if torch.equal(packed, plain) else "the packed product differs from F.linear's"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (an mkldnn tensor only `linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    """`F.linear(x, weight, bias)` for a plain or a packed (`pack`) weight, a wide fp32 one in blocks
    (`blocked_linear`) once its first call showed the same result; `x` is [rows, in]."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[0] < 4 * WIDE_BLOCK:
        return F.linear(x, weight, bias)
    key = (weight.shape[0], weight.shape[1])
    if key not in _blocks_match:
        plain = F.linear(x, weight, bias)
        _blocks_match[key] = torch.equal(blocked_linear(x, weight, bias), plain)
        if not _blocks_match[key]:
            log.info("wide fp32 product %s: blocks differ from F.linear here, kept whole", list(key))
        return plain
    return blocked_linear(x, weight, bias) if _blocks_match[key] else F.linear(x, weight, bias)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as one GEMM per `WIDE_BLOCK` output features, written into one output: MKL
    runs a [rows x in] by [in x 2048] product near its peak and the [in x 49152] one far below it."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], WIDE_BLOCK):
        stop = start + WIDE_BLOCK
        out[:, start:stop] = F.linear(x, weight[start:stop], None if bias is None else bias[start:stop])
    return out
