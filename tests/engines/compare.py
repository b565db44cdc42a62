"""Differences between two backends' tensors, as the parity tests compare them."""

from __future__ import annotations

import torch


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element difference over same-named tensors (the names must match)."""
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest difference where `mask` is set (response tokens)."""
    return float(((a - b).abs() * mask).max())
