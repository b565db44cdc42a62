"""The start-up ETA: steps, evaluations and checkpoints timed apart and the ones still due counted from the plan,
so the first step's figure holds within 25 % where evaluations come in windows (the demo's cadence)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstages.configs import load_config
from rlstages.configs.evaluation import EvalWindow, eval_due
from rlstages.flows import progress
from rlstages.flows.progress import Plan, RunProgress, configured_shape

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("step_s", "eval_s", "every", "windows"),
    [(62.0, 47.0, 2, []), (20.0, 12.0, 6, [EvalWindow(first=8, last=18, every=2)])],
    ids=["issue-53-avx2-before", "demo-cadence"],
)
def test_the_eta_from_the_first_step_holds(
    monkeypatch: pytest.MonkeyPatch, step_s: float, eval_s: float, every: int, windows: list[EvalWindow]
) -> None:
    """A 30-step run (the first step 30 % slower: warm-ups), evaluations at the start and on a cadence, a 3 s
    checkpoint every 5: the ETA said after step 1 is within 25 % of the time the run then took (the issue's
    machine: 62 s steps, 47 s evaluations every 2 steps, where steps left x wall time per step was 28 % short),
    and it is exact once a step after the first and a checkpoint are measured."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    plan = Plan(lambda k: eval_due(k, every, windows, 30), lambda k: k % 5 == 0 or k == 30, (eval_s,))
    ui = RunProgress(None, None, 30, 0, None, plan)
    monkeypatch.setattr(ui, "_say", lambda line: None)
    monkeypatch.setattr(ui, "log", type("Quiet", (), {"info": lambda *a: None, "warning": lambda *a: None})())
    said: dict[int, float] = {}
    ends: dict[int, float] = {}
    for step in range(1, 31):
        clock.now += step_s * (1.3 if step == 1 else 1.0)
        ui.step_done(step, {})
        said[step] = ui.eta_seconds(step)
        after_step = clock.now
        ends[step] = after_step
        if plan.evaluates(step):
            ui.stage("evaluate")
            clock.now += eval_s
            ui.evaluated(step, {})
        if plan.checkpoints(step):
            ui.stage("checkpoint")
            clock.now += 3.0
            ui.written()
        if step == 1:
            end_of_first = after_step
    took = clock.now - end_of_first
    assert abs(said[1] - took) <= 0.25 * took
    assert said[1] > 29 * step_s  # the evaluations and checkpoints ahead are in it, not only the steps
    assert said[6] == pytest.approx(clock.now - ends[6])


def _replay(
    monkeypatch: pytest.MonkeyPatch,
    plan: Plan,
    steps: list[tuple[float, float]],
    evals: dict[int, float],
    save_s: float | dict[int, float],
) -> tuple[dict[int, float], dict[int, float], float]:
    """Replay a run's timings through a RunProgress: `steps` (wall seconds, of which compiling) per step,
    `evals` the seconds of each evaluation after a step, `save_s` each checkpoint. Returns the ETA said after
    each step, the clock at each step's end and the clock at the run's end."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    ui = RunProgress(None, None, len(steps), 0, None, plan)
    monkeypatch.setattr(ui, "_say", lambda line: None)
    monkeypatch.setattr(ui, "log", type("Quiet", (), {"info": lambda *a: None, "warning": lambda *a: None})())
    said: dict[int, float] = {}
    ends: dict[int, float] = {}
    for step, (wall, compiling) in enumerate(steps, start=1):
        clock.now += wall
        ui.step_done(step, {"perf/compile_s/actor": compiling} if compiling else {})
        said[step], ends[step] = ui.eta_seconds(step), clock.now
        if plan.evaluates(step):
            ui.stage("evaluate")
            clock.now += evals[step]
            ui.evaluated(step, {})
        if plan.checkpoints(step):
            ui.stage("checkpoint")
            clock.now += save_s if isinstance(save_s, float) else save_s[step]
            ui.written()
    return said, ends, clock.now


def test_compiling_in_the_first_step_is_left_out_of_the_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's first update compiles its AdamW step (`perf/compile_s/actor`, 17 s of a 67 s step on
    the AVX2 EPYC): the ETA after step 1 counts the 29 steps left at the compiled-out time, exactly."""
    plan = Plan(lambda k: k == 30, lambda k: False, (20.0,))  # the start's evaluation took 20 s
    said, ends, end = _replay(monkeypatch, plan, [(67.0, 17.0)] + [(50.0, 0.0)] * 29, {30: 20.0}, 0.0)
    assert said[1] == pytest.approx(29 * 50.0 + 20.0)
    assert said[1] == pytest.approx(end - ends[1])


def test_the_eta_from_the_first_step_holds_on_the_avx2_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's timings on the AVX2-only EPYC (2026-11-29, 11:31 run, before the load of other runs came):
    the start's evaluation 19.9 s + 1.2 s of logging and plot, step 1 66.8 s (generate 17.8, update 48.9 of
    which the AdamW compile is the excess over the steady update, 32.6 s in issue 53: 16.3 s), then 50.5 s a
    step, 21 s an evaluation on the demo's cadence, 3 s a checkpoint every 5. The ETA after step 1 is within
    25 % of what the run then took; without the compile left out it said 27 % too much."""
    every, windows = 6, [EvalWindow(first=8, last=18, every=2)]
    plan = Plan(lambda k: eval_due(k, every, windows, 30), lambda k: k % 5 == 0 or k == 30, (21.1,))
    steps = [(66.8, 16.3)] + [(50.5, 0.0)] * 29
    evals = {k: 21.0 for k in range(1, 31)}
    said, ends, end = _replay(monkeypatch, plan, steps, evals, 3.0)
    took = end - ends[1]
    assert abs(said[1] - took) <= 0.25 * took
    blind, _, _ = _replay(monkeypatch, plan, [(66.8, 0.0)] + steps[1:], evals, 3.0)  # compile not reported
    assert blind[1] - took > 0.25 * took  # the arithmetic this test guards: off by more than 25 % without it


# The AVX2 EPYC's demo, recorded (2026-11-29, the 11:52 run, other runs' tests loading the machine at first): each
# step's wall time (its log line from the mark before), each evaluation's and checkpoint's, the start's evaluation.
AVX2_STEPS = [110.2, 82.8, 79.5, 66.8, 57.9, 55.3, 46.5, 54.9, 53.0, 43.0, 46.8, 42.3, 51.5, 44.2, 52.3]
AVX2_STEPS += [50.4, 50.2, 53.1, 53.0, 59.8, 50.7, 50.3, 52.6, 54.6, 57.1, 58.2, 65.4, 57.7, 43.9, 54.1]
AVX2_EVALS = {6: 20.6, 8: 22.2, 10: 14.8, 12: 16.9, 14: 22.5, 16: 19.8, 18: 19.0, 24: 20.4, 30: 18.4}
AVX2_SAVES = {5: 3.7, 10: 4.7, 15: 4.6, 20: 4.6, 25: 4.2, 30: 4.9}


def test_the_eta_on_the_recorded_avx2_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded run: its steps fall from ~80 s to ~50 s as the replies shorten from 24 to 11 tokens (steps
    1-6), which no first step can know (its ETA says ~2x); from step 7 on the ETA over the last 5 steps is within
    25 % of what the rest took, where the mean of every step since the first was still 26 % over at step 7."""
    windows = [EvalWindow(first=8, last=18, every=2)]
    plan = Plan(lambda k: eval_due(k, 6, windows, 30), lambda k: k % 5 == 0 or k == 30, (36.3,))
    steps = [(s, 0.0) for s in AVX2_STEPS]
    said, ends, end = _replay(monkeypatch, plan, steps, AVX2_EVALS, AVX2_SAVES)
    error = {k: (said[k] - (end - ends[k])) / (end - ends[k]) for k in range(1, 30)}
    assert all(abs(error[k]) <= 0.25 for k in range(7, 30)), {k: round(e, 2) for k, e in error.items()}
    assert error[1] > 0.8  # the first step's own time, 2x the later ones'
    monkeypatch.setattr(progress, "RECENT_STEPS", 30)  # every step since the first: the arithmetic before
    mean_said, _, _ = _replay(monkeypatch, plan, steps, AVX2_EVALS, AVX2_SAVES)
    assert (mean_said[7] - (end - ends[7])) / (end - ends[7]) > 0.25


# The demo's recorded `timing/step_s` on the AMX Xeon (2026-11-30, three seeds of one preset, MLflow), step 1's
# compiling apart: the steps' cost falls ~40 % over the first 8 as the replies shorten, which one step cannot see.
DEMO_SEED_0 = [16.2, 11.9, 11.2, 12.2, 10.6, 9.2, 10.1, 7.8, 7.1, 8.3, 10.3, 6.3, 7.3, 9.3, 7.1, 7.6, 7.4, 6.6, 6.7,
               7.0, 5.9, 6.6, 9.7, 7.4, 8.2, 8.4, 8.8, 9.0, 11.1, 10.7]  # fmt: skip
DEMO_EARLIER = {  # (timing/step_s, step 1's compiling) of the other two seeds
    "seed-1": ([20.9, 13.2, 10.5, 8.5, 8.1, 9.0, 9.2, 8.8, 12.6, 8.9, 9.5, 9.0, 10.5, 7.9, 8.4, 9.0, 7.9, 7.6, 9.9,
                5.7, 6.0, 9.0, 7.7, 7.3, 7.6, 7.3, 8.6, 6.1, 7.4, 5.8], 5.6),
    "seed-2": ([16.4, 11.5, 11.6, 10.1, 11.1, 9.0, 7.8, 8.4, 6.8, 9.2, 6.8, 8.0, 10.1, 10.5, 9.4, 11.8, 10.6, 10.1,
                10.0, 10.2, 8.0, 8.0, 8.0, 7.4, 7.5, 7.5, 6.9, 7.6, 8.0, 5.3], 4.8),
}  # fmt: skip


@pytest.mark.parametrize("earlier", sorted(DEMO_EARLIER))
def test_an_earlier_run_gives_the_eta_the_shape_of_the_steps_ahead(
    monkeypatch: pytest.MonkeyPatch, earlier: str
) -> None:
    """Seed 0's demo replayed with another seed's step times as the earlier run (`Plan.earlier_step_s`, compiling
    out, as `earlier_step_seconds` reads them from MLflow): after step 1 the ETA is within 25 % of what the run then
    took; from its own steps alone it said over 30 % too much. Once steps are measured, their ratio to the same
    steps of the earlier run scales the rest: exact when this run is the earlier one at another speed."""
    every, windows = 6, [EvalWindow(first=8, last=18, every=2)]
    evaluates, saves = (lambda k: eval_due(k, every, windows, 30)), (lambda k: k % 5 == 0 or k == 30)
    steps = [(DEMO_SEED_0[0], 4.5)] + [(s, 0.0) for s in DEMO_SEED_0[1:]]
    evals = {k: 3.2 for k in range(1, 31)}
    times, compiling = DEMO_EARLIER[earlier]
    shape = (times[0] - compiling, *times[1:])
    said, ends, end = _replay(monkeypatch, Plan(evaluates, saves, (11.6,), shape), steps, evals, 3.0)
    took = end - ends[1]
    assert abs(said[1] - took) <= 0.25 * took, (said[1], took)
    alone, _, _ = _replay(monkeypatch, Plan(evaluates, saves, (11.6,)), steps, evals, 3.0)
    assert alone[1] - took > 0.3 * took, (alone[1], took)  # what the earlier run corrects
    slower = [(1.5 * wall, 1.5 * c) for wall, c in steps]  # the same run, 1.5x slower: its own shape is exact
    own = (DEMO_SEED_0[0] - 4.5, *DEMO_SEED_0[1:])
    said, ends, end = _replay(monkeypatch, Plan(evaluates, saves, (), own), slower, {k: 0.0 for k in evals}, 0.0)
    assert said[1] == pytest.approx(end - ends[1])


def test_an_earlier_run_shorter_than_this_one_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier run that timed fewer steps than this run's total cannot shape it: the steps' own mean applies."""
    steps = [(10.0, 0.0), (8.0, 0.0), (8.0, 0.0), (8.0, 0.0)]
    said, _, _ = _replay(monkeypatch, Plan(earlier_step_s=(20.0, 1.0, 1.0)), steps, {}, 0.0)
    assert said[2] == pytest.approx(2 * 8.0)


DEMO_SEEDS = {"seed-0": (DEMO_SEED_0, 4.5), **DEMO_EARLIER}
# The demo on a Zen 4 EPYC (native bf16 on 256-bit units, 2026-12-03, MLflow's `timing/step_s`, step 1's
# compiling, then the start's evaluation s and a later one's; the first run under bench.pss, the next alone): its
# steps fall ~20 % over the first ones, not ~40 % as on the AMX Xeon; the update (bf16) is ~70 % of a step and
# shortens less with the replies than the generation does.
ZEN4_RUNS = {
    "zen4-a": ([19.4, 12.4, 12.1, 11.4, 9.9, 10.6, 11.2, 9.2, 13.0, 11.9, 11.7, 9.9, 10.6, 10.4, 12.8, 10.5, 10.0,
                9.5, 14.4, 9.2, 8.1, 8.7, 11.7, 9.4, 8.7, 10.3, 11.4, 8.8, 10.2, 8.9], 5.8, 5.1, 4.6),
    "zen4-b": ([19.6, 13.8, 13.9, 11.2, 11.0, 9.6, 10.0, 9.6, 11.4, 10.8, 11.1, 11.7, 11.5, 12.5, 12.8, 9.6, 9.3,
                8.3, 10.8, 9.5, 10.2, 9.2, 10.3, 7.0, 7.9, 10.3, 8.8, 8.2, 8.8, 7.0], 4.9, 6.4, 4.3),
}  # fmt: skip
# each recorded demo: (steps, step 1's compiling, the start's evaluation s, a later one's s, its CPU's class)
RECORDED_DEMOS = {
    **{seed: (*run, 11.6, 3.2, "native-bf16") for seed, run in DEMO_SEEDS.items()},  # the AMX Xeon
    **{name: (*run, "native-bf16") for name, run in ZEN4_RUNS.items()},
}


def _demo_plan(start_eval_s: float, shaped: bool, cpu_class: str = "native-bf16") -> Plan:
    """The demo's plan (configs/demo.yaml's cadence, a checkpoint every 5), with its step cost shape for
    `cpu_class` (`trainer.cost_shape`) or none."""
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    total, every, windows = cfg.trainer.total_steps, cfg.trainer.eval_every, cfg.trainer.eval_windows
    shape = configured_shape(cfg.trainer.cost_shape(cpu_class), total) if shaped else ()
    return Plan(
        lambda k: eval_due(k, every, windows, total), lambda k: k % 5 == 0 or k == total, (start_eval_s,), shape
    )


def _steps(times: list[float], compiling: float) -> list[tuple[float, float]]:
    """A recorded run's steps as `_replay` takes them: step 1's compiling apart."""
    return [(times[0], compiling)] + [(s, 0.0) for s in times[1:]]


def _off(said: dict[int, float], ends: dict[int, float], end: float, steps: range) -> dict[int, float]:
    """The ETA's relative error after each of `steps` against what the run then took."""
    return {k: round((said[k] - (end - ends[k])) / (end - ends[k]), 2) for k in steps}


@pytest.mark.parametrize("run", sorted(RECORDED_DEMOS))
def test_the_demo_configs_shape_gives_the_first_step_its_eta(monkeypatch: pytest.MonkeyPatch, run: str) -> None:
    """A first demo run (no earlier run of its config in mlflow.db) takes its ETA's shape from configs/demo.yaml
    (`trainer.step_cost_shape`, or `step_cost_shape_by_class` for its CPU's class): replayed on each recorded
    native-bf16 run (three AMX seeds, a Zen 4 EPYC), the ETA after each of steps 1-8 (the shape's falling part;
    later, the ETA follows the last 5 steps) is within 25 % of what the run then took."""
    times, compiling, start_eval, eval_s, cpu_class = RECORDED_DEMOS[run]
    evals = {k: eval_s for k in range(1, 31)}
    plan = _demo_plan(start_eval, shaped=True, cpu_class=cpu_class)
    said, ends, end = _replay(monkeypatch, plan, _steps(times, compiling), evals, 3.0)
    off = _off(said, ends, end, range(1, 9))
    assert all(abs(e) <= 0.25 for e in off.values()), {k: e for k, e in off.items() if abs(e) > 0.25}


def test_the_avx2_demo_takes_the_general_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded AVX2 demo (its steps fall ~2x as the replies shorten) replayed with the shape its class gets
    (the general `step_cost_shape`): within 25 % after each of steps 1-8; with the native-bf16 class's shallower
    shape its first step's ETA would say over 25 % too much."""
    said, ends, end = _replay(
        monkeypatch, _demo_plan(36.3, True, "avx2"), [(s, 0.0) for s in AVX2_STEPS], AVX2_EVALS, AVX2_SAVES
    )
    off = _off(said, ends, end, range(1, 9))
    assert all(abs(e) <= 0.25 for e in off.values()), off
    other, ends, end = _replay(
        monkeypatch, _demo_plan(36.3, True, "native-bf16"), [(s, 0.0) for s in AVX2_STEPS], AVX2_EVALS, AVX2_SAVES
    )
    assert _off(other, ends, end, range(1, 2))[1] > 0.25


def test_the_zen4_demo_needs_its_class_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the class's shape corrects: the Zen 4 run under the general shape (fitted where the steps halve)
    had the ETA over 25 % short after its first steps."""
    times, compiling, start_eval, eval_s, _ = RECORDED_DEMOS["zen4-a"]
    plan = _demo_plan(start_eval, shaped=True, cpu_class="avx2")
    said, ends, end = _replay(monkeypatch, plan, _steps(times, compiling), {k: eval_s for k in range(1, 31)}, 3.0)
    assert _off(said, ends, end, range(1, 2))[1] < -0.25


def test_without_the_shape_the_first_step_overshoots_on_some_amx_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the shape corrects: on the same recorded AMX seeds, the ETA after step 1 from the steps' own time said
    over 25 % too much on some seed."""
    evals = {k: 3.2 for k in range(1, 31)}
    errors = {}
    for seed, recorded in DEMO_SEEDS.items():
        alone, ends, end = _replay(monkeypatch, _demo_plan(11.6, shaped=False), _steps(*recorded), evals, 3.0)
        errors[seed] = _off(alone, ends, end, range(1, 2))[1]
    assert max(errors.values()) > 0.25, errors


def test_a_configured_shape_covers_every_step() -> None:
    """`trainer.step_cost_shape` shorter than the run: the steps past its end cost as its last; none: ()."""
    assert configured_shape([2.0, 1.5, 1.0], 5) == (2.0, 1.5, 1.0, 1.0, 1.0)
    assert configured_shape([2.0, 1.5, 1.0], 2) == (2.0, 1.5)
    assert configured_shape([], 5) == ()


def test_an_evaluation_ahead_costs_as_the_step_it_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the steps' shape, the start's evaluation (30 s, before a step of cost 2) prices the ones due after the
    cost-1 steps at 15 s each."""
    plan = Plan(lambda k: k in (2, 4), lambda k: False, (30.0,), (2.0, 1.0, 1.0, 1.0))
    said, _, _ = _replay(
        monkeypatch, plan, [(20.0, 0.0), (10.0, 0.0), (10.0, 0.0), (10.0, 0.0)], {2: 15.0, 4: 15.0}, 0.0
    )
    assert said[1] == pytest.approx(3 * 10.0 + 2 * 15.0)


def test_a_step_cost_that_is_not_positive_is_refused() -> None:
    """A zero or negative relative cost fails the config with the field named."""
    with pytest.raises(ValueError, match=r"trainer.step_cost_shape: 0.0 is not a positive relative cost"):
        load_config(ROOT / "configs" / "demo.yaml", ["trainer.step_cost_shape=[1.5,0.0]"])


# The AVX2 EPYC's first demo run from a clean clone (2026-12-02, 6b703c8, MLflow): `timing/step_s`, step 1's compiling
# (`perf/compile_s/actor`), each evaluation's `time/eval_s` (the start's with its warm-ups) and the checkpoints' ~4 s.
AVX2_FIRST_RUN = [105.6, 68.1, 60.5, 54.7, 50.1, 40.7, 39.0, 33.3, 30.2, 31.1, 30.7, 28.8, 26.5, 26.9, 32.4, 36.0,
                  29.0, 30.8, 33.0, 25.9, 30.3, 25.8, 30.9, 26.2, 29.3, 29.3, 35.7, 26.0, 26.0, 33.1]  # fmt: skip
AVX2_FIRST_EVALS = {0: 29.1, 6: 22.0, 8: 16.9, 10: 13.1, 12: 12.5, 14: 14.4, 16: 14.9, 18: 12.4, 24: 18.9, 30: 19.8}


def test_the_demo_configs_shape_on_the_avx2_epycs_first_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 EPYC's first demo run, replayed: with configs/demo.yaml's shape the ETA after every step is within
    25 % of what the run then took (live, with the shape's first draft: 22 min 40 s said after step 1 for ~19.5
    min, +16 %); from the first step's own time it said over 60 % too much (steps 2-5 cost 1.7-2.3x the later
    ones on this class, 1.2-1.5x on the AMX Xeon: the general shape is this class's, the native-bf16 one shallower)."""
    steps, start = _steps(AVX2_FIRST_RUN, 38.8), AVX2_FIRST_EVALS[0]
    said, ends, end = _replay(monkeypatch, _demo_plan(start, True, "avx2"), steps, AVX2_FIRST_EVALS, 4.0)
    off = _off(said, ends, end, range(1, 30))
    assert all(abs(e) <= 0.25 for e in off.values()), {k: e for k, e in off.items() if abs(e) > 0.25}
    took = end - ends[1]
    alone, _, _ = _replay(monkeypatch, _demo_plan(start, shaped=False), steps, AVX2_FIRST_EVALS, 4.0)
    assert alone[1] - took > 0.6 * took, (alone[1], took)
