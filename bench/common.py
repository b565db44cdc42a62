"""Shared bench helpers: a small model built from a config, timing, the machine's speed, and the results
each bench records (one JSON line per figure, collected by `python -m bench` into bench/results.json)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS_ENV = "RLSTAGES_BENCH_RESULTS"  # a JSON-lines file `python -m bench` hands every bench process

# HF config fields of the real models the GPU benches take the shape of (random weights), ties included.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    "qwen2-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


def shape_fields(name: str, *drop: str) -> dict[str, Any]:
    """The HF config fields of `MODEL_SHAPES[name]` without `model_type` and the fields named in `drop`."""
    return {k: v for k, v in MODEL_SHAPES[name].items() if k != "model_type" and k not in drop}


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


def goal_met(ratio: float, goal: str | None) -> bool | None:
    """Whether `ratio` meets a goal written "<= x" or ">= x" (None: no goal, informative only)."""
    if not goal:
        return None
    op, _, value = goal.partition(" ")
    return ratio <= float(value) if op == "<=" else ratio >= float(value)


def record(name: str, ratio: float, goal: str | None, detail: str = "") -> dict[str, Any]:
    """Record one figure (a ratio against a baseline of the same run) for `python -m bench`'s table.

    Appended to the file named by $RLSTAGES_BENCH_RESULTS when a bench runs under `python -m bench`; always
    printed, so a bench run alone still shows it.
    """
    row = {
        "name": name,
        "ratio": round(float(ratio), 4),
        "goal": goal,
        "ok": goal_met(ratio, goal),
        "detail": detail,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"[bench] {json.dumps(row)}", flush=True)
    out = os.environ.get(RESULTS_ENV)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def matmul_flops(dtype: str = "float32", n: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of a plain square matmul (2*n^3 per product) in `dtype` with this process's threads: the
    machine's compute speed, the baseline of bench_step and the figure stated beside every result."""
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    out = torch.empty(n, n, dtype=dt)
    torch.mm(a, b, out=out)  # warm-up
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def memory_bandwidth(mb: int = 256, seconds: float = 1.0) -> float:
    """Bytes/s of a large tensor copy (read + write), the bound on streaming weights through the cores."""
    import torch

    src = torch.empty(mb << 18, dtype=torch.float32).fill_(1.0)  # mb MB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


class PssSampler:
    """Peak PSS summed over a process and all its descendants, sampled from /proc/*/smaps_rollup (psutil's
    memory_full_info) every `interval` seconds on a background thread. PSS shares pages fairly, so Ray
    workers mapping the same libraries are not counted twice."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        import threading

        self.pid, self.interval, self.peak = pid, interval, 0
        self.peak_at = 0.0  # seconds after the sampler started
        self.peak_breakdown: list[tuple[int, str]] = []  # (PSS bytes, process title) at the peak, largest first
        self.series: list[tuple[float, int, int]] = []  # (seconds, PSS of the tree, PSS of its largest process)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> int:
        """PSS bytes of the tree now."""
        return sum(pss for pss, _ in self._per_process())

    def _per_process(self) -> list[tuple[int, str]]:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        found = []
        for proc in procs:
            try:
                found.append((proc.memory_full_info().pss, " ".join(proc.cmdline())[:110] or proc.name()))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return sorted(found, reverse=True)

    def _run(self) -> None:
        import time

        start = time.perf_counter()
        while not self._stop.is_set():
            now = self._per_process()
            self.series.append((time.perf_counter() - start, sum(pss for pss, _ in now), now[0][0] if now else 0))
            if sum(pss for pss, _ in now) > self.peak:
                self.peak, self.peak_breakdown = sum(pss for pss, _ in now), now
                self.peak_at = time.perf_counter() - start
            self._stop.wait(self.interval)


def tiny_run_config(tmp: Path, model: Path, name: str, steps: int, *overrides: str) -> Any:
    """configs/tiny.yaml on `model`, `steps` steps in `tmp` with no evaluation, checkpoints or logged model (the
    flow benches' common run), plus each bench's own `overrides`."""
    from rlstages.configs import load_config

    base = [
        f"model.path={model}",
        "model.provider=local",
        f"trainer.output_dir={tmp}",
        f"trainer.run_name={name}",
        f"trainer.total_steps={steps}",
        "trainer.eval_every=0",
        "trainer.eval_at_start=false",
        "checkpoint.every=0",
        f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        "tracking.log_model=false",
    ]
    return load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", [*base, *overrides])


def run_named(tracking_uri: str, experiment: str, name: str) -> str:
    """The id of the newest MLflow run called `name` in `experiment` (a flow bench's run read back)."""
    from rlstages.tasks.driver.tracking.queries import experiment_id, experiment_runs

    exp_id, _ = experiment_id(tracking_uri, experiment)
    found = experiment_runs(tracking_uri, exp_id, 1, f"attributes.run_name = '{name}'")
    if not found:
        raise ValueError(f"no run {name!r} in experiment {experiment!r} of {tracking_uri}")
    return found[-1].run_id


def seconds_per_step(tracking_uri: str, run_id: str) -> float:
    """Wall seconds per step after the first, from the run's `progress/step` timestamps."""
    from mlflow import MlflowClient

    stamps = sorted(m.timestamp for m in MlflowClient(tracking_uri).get_metric_history(run_id, "progress/step"))
    return (stamps[-1] - stamps[0]) / 1000 / (len(stamps) - 1)
