"""bench/bench_demo.py reads issue 53's figures back from a demo's MLflow run: the first held-out evaluation >= 0.8
(its step and minutes after the run's start), the last one, the evaluations' share, the goal of the time by the
run's class of CPU; a run that never reaches 0.8 fails its goals instead of passing them. A real MLflow SQLite store
with runs logged as the flow logs them (timestamps given). CPU only, ~5 s.
Run: pytest tests/test_bench_demo.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.bench_demo import demo_figures, record_figures
from bench.common import RESULTS_ENV


def log_run(uri: str, name: str, cpu_class: str, evals: list[tuple[int, float, float]], fraction: float) -> None:
    """A finished run: `evals` (step, held-out reward, minutes after its start) and the eval fraction at the end."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("bench-demo")
    exp_id = exp.experiment_id if exp is not None else client.create_experiment("bench-demo")
    start = 1_800_000_000_000
    run = client.create_run(exp_id, start_time=start, run_name=name, tags={"machine.class": cpu_class})
    for step, value, minutes in evals:
        client.log_metric(run.info.run_id, "eval/reward_mean", value, int(start + minutes * 60_000), step)
    client.log_metric(run.info.run_id, "time/eval_fraction", fraction, start + 300_000, evals[-1][0])
    client.set_terminated(run.info.run_id)


def test_the_first_evaluation_over_08_its_minutes_and_the_goals_by_class(tmp_path: Path, monkeypatch) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log_run(uri, "bench-demo", "native-bf16", [(0, 0.23, 0.2), (14, 0.797, 2.5), (16, 0.83, 2.7), (30, 0.84, 4.6)], 0.1)
    got = demo_figures(uri, "bench-demo", "bench-demo")
    assert got["first_step"] == 16 and got["minutes_to_08"] == pytest.approx(2.7)  # 0.797 is not 0.8
    assert got["final"] == pytest.approx(0.84) and got["eval_fraction"] == pytest.approx(0.1)
    assert got["cpu_class"] == "native-bf16" and got["curve"][1] == (14, 0.797)

    out = tmp_path / "rows.jsonl"
    monkeypatch.setenv(RESULTS_ENV, str(out))
    record_figures(got, peak_gb=3.4, wall_s=290.0)
    rows = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["demo_minutes_to_08"]["goal"] == "<= 2" and rows["demo_minutes_to_08"]["ok"] is False  # 2.7 min
    assert rows["demo_first_08_step"]["ok"] and rows["demo_final_heldout"]["ok"] and rows["demo_eval_fraction"]["ok"]
    assert rows["demo_peak_pss_gb"]["ok"] and "native-bf16" in rows["demo_peak_pss_gb"]["detail"]


def test_a_run_that_never_reaches_08_fails_its_goals(tmp_path: Path, monkeypatch) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log_run(uri, "bench-demo", "avx2", [(0, 0.2, 1.0), (30, 0.7, 20.0)], 0.2)
    got = demo_figures(uri, "bench-demo", "bench-demo")
    assert got["first_step"] is None and math.isnan(got["minutes_to_08"])
    out = tmp_path / "rows.jsonl"
    monkeypatch.setenv(RESULTS_ENV, str(out))
    record_figures(got, peak_gb=3.9, wall_s=1500.0)
    rows = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["demo_minutes_to_08"]["goal"] == "<= 12"
    assert not any(rows[n]["ok"] for n in rows), rows  # none of the five goals met


def test_a_missing_run_is_named(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log_run(uri, "other", "avx2", [(0, 0.2, 1.0)], 0.2)
    with pytest.raises(LookupError, match="'bench-demo'"):
        demo_figures(uri, "bench-demo", "bench-demo")


def test_a_run_on_one_class_of_cpu_replaces_its_own_rows_and_keeps_another_classs() -> None:
    from bench.__main__ import markdown, merge_rows

    def row(name: str, ratio: float, cls: str) -> dict:
        return {"name": name, "ratio": ratio, "goal": None, "ok": None, "detail": "", "load_avg": [1.0],
                "cpu_class": f"{cls}: a CPU, 2 CPUs, 2026-12-07"}  # fmt: skip

    saved = [row("demo_minutes_to_08", 2.9, "native-bf16"), row("demo_minutes_to_08", 14.0, "avx2"),
             row("demo_peak_pss_gb", 3.4, "native-bf16")]  # fmt: skip
    merged = merge_rows(saved, [row("demo_minutes_to_08", 11.0, "avx2")])
    by_class = {(r["name"], r["cpu_class"].partition(":")[0]): r["ratio"] for r in merged}
    assert by_class == {("demo_minutes_to_08", "native-bf16"): 2.9, ("demo_peak_pss_gb", "native-bf16"): 3.4,
                        ("demo_minutes_to_08", "avx2"): 11.0}  # fmt: skip
    assert "| `demo_minutes_to_08` | avx2 | 11 |" in markdown(merged)
