"""Shared bench helpers: a small model built from a config, timing, and a results table."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def small_model(hidden: int = 256, layers: int = 4, vocab: int = 2048, name: str = "bench-model") -> Path:
    """A random Qwen2 of a few million parameters, built once into the temp dir."""
    from rlstages.engines.models import build_tiny_model

    path = Path(tempfile.gettempdir()) / f"rlstages-{name}-{hidden}x{layers}"
    if not (path / "config.json").is_file():
        build_tiny_model(
            path,
            hidden_size=hidden,
            intermediate_size=hidden * 3,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab,
        )
    return path


def best_of(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Median wall time of `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(title: str, rows: list[tuple[str, float, float, str]]) -> None:
    """Print (case, ours s, baseline s, goal) with the ratio."""
    table = Table("case", "ours (s)", "baseline (s)", "ratio", "goal", title=title)
    for case, ours, base, goal in rows:
        table.add_row(case, f"{ours:.3f}", f"{base:.3f}", f"{ours / base:.3f}", goal)
    Console().print(table)
