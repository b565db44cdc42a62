"""The evaluation cadence: `trainer.eval_every` with denser `trainer.eval_windows`, and the demo's preset."""

from __future__ import annotations

from pathlib import Path

from rlstages.configs import load_config
from rlstages.configs.evaluation import EvalWindow, eval_due

ROOT = Path(__file__).resolve().parents[2]


def test_windows_replace_the_cadence_inside_them() -> None:
    windows = [EvalWindow(first=8, last=18, every=2)]
    assert [s for s in range(1, 31) if eval_due(s, 6, windows, 30)] == [6, 8, 10, 12, 14, 16, 18, 24, 30]
    assert [s for s in range(1, 11) if eval_due(s, 0, [], 10)] == [10]  # 0: only the end (and the start)
    assert [s for s in range(1, 7) if eval_due(s, 2, [], 6)] == [2, 4, 6]


def test_the_demo_evaluates_every_two_steps_where_it_crosses() -> None:
    """The README's "first held-out >= 0.8" (step 14 on every machine so far, by step 16 in the issue's goal)
    keeps its 2-step resolution; the demo evaluates 9 times after the start instead of 15."""
    cfg = load_config(ROOT / "configs" / "demo.yaml", [])
    due = [
        s
        for s in range(1, cfg.trainer.total_steps + 1)
        if eval_due(s, cfg.trainer.eval_every, cfg.trainer.eval_windows, 30)
    ]
    assert {10, 12, 14, 16, 18} <= set(due) and len(due) == 9
