"""The simulator of asynchronous training (engines/async_sim) against the real async flow: three runs of the tiny
preset (the trainer and the rollout worker as Ray actors, real Prefect and MLflow, 8 steps) at eta 0, 1 and 2;
the simulator is fitted from the eta-0 run's recorded per-step metrics (tasks/driver/async_fit.py) and predicts
the others' samples per second.

What is compared (the machine is two shared cores whose load changes between runs): the measured samples/s of a
run over steps 2-8 is samples / the median of its recorded `timing/step_s` (the trainer's step, its waits
included; step 1 pays the warm-up), multiplied by (the run's median trainer busy time per step / the eta-0 run's):
the load's effect on the trainer's own recorded stage times divided out. The prediction is the simulator's steady
rate over the same steps, with the eta-0 run's latencies. Within 15 %; a miss runs the three again once.

Sized so that noise does not decide it: 32 replies of 48 tokens a step, 7 steps measured, and the rollout worker
in its own process (in the driver, generation and training contend for one GIL: the trainer's stage times
doubled at eta 1). At tiny.yaml's 4 steps of 16 8-token replies in the driver a step took ~0.3 s and the
predictions missed by up to 2x even on an idle machine.

The second test does the same across rollout:trainer splits (1:1, 2:1, 3:1 at eta 1), every Ray worker capped at
0.4 of a CPU by cgroup so that the workers act as equal devices on the two cores, with replies long enough (192
tokens) that generation sets the pace at 1:1. A timing comparison: the serial tier, which owns the machine
(tests/README.md); ~2.5 + ~4.5 minutes."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from cpu_caps import CpuCaps
from flow_support import tiny_cfg

from rlstages.engines.async_sim.fit import fit_profile, memory_bound_share, stage_times
from rlstages.engines.async_sim.probe import batch_times
from rlstages.engines.async_sim.sim import SimConfig, simulate
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.async_fit import recorded_steps, run_shape

pytestmark = pytest.mark.serial  # a timing comparison: it owns the machine (tests/README.md)

STEPS = 8
RUN = ("cluster.hybrid_engine=false", f"trainer.total_steps={STEPS}", "trainer.eval_every=0",
       "trainer.eval_at_start=false", "checkpoint.every=0", "trainer.mode=async",
       "rollout.max_new_tokens=48", "data.prompts_per_step=8")  # fmt: skip


def trainer_busy_s(steps: list[dict[str, float]]) -> float:
    """Median trainer time per step (its stages and the sync, no waits) over steps 2..N."""
    return statistics.median(sum(stage_times(m)[1:]) for m in steps[1:])


def measured_samples_per_s(steps: list[dict[str, float]], samples_per_step: int) -> float:
    """Steady samples per second of steps 2..N by the run's own recorded step times: at their median step time,
    which one stalled step (0.83 s among ~0.3 s ones, seen on an idle machine) does not move as it moves the sum."""
    return samples_per_step / statistics.median(m["timing/step_s"] for m in steps[1:])


def eta_report(tmp_path: Path, tiny_model_dir: Path, attempt: int) -> tuple[dict, dict]:
    """Three async runs at eta 0, 1, 2; the simulator fitted from the eta-0 one: (report by eta as (predicted,
    measured, load), each run's steps as (step_s, generate, train, sync))."""
    runs = {}
    for eta in (0, 1, 2):
        name = f"eta{eta}-try{attempt}"
        cfg = tiny_cfg(tmp_path, tiny_model_dir, name, *RUN, f"trainer.async.max_staleness={eta}")
        rl_post_train(cfg)
        runs[eta] = (cfg, recorded_steps(cfg))
    cfg0, steps0 = runs[0]
    assert len(steps0) == STEPS and all("rollout/generate_wall_s" in m for m in steps0)
    shape = run_shape(cfg0)
    profile = fit_profile(steps0, shape)
    samples = shape.groups_per_step * shape.samples_per_group
    report, per_step = {}, {}
    for eta, (_, steps) in runs.items():
        sim = simulate(profile, SimConfig(shape.groups_per_step, shape.samples_per_group, eta, STEPS))
        predicted = sim.steady_samples_per_s(samples)
        load = trainer_busy_s(steps) / trainer_busy_s(steps0)
        measured = measured_samples_per_s(steps, samples) * load
        report[eta] = (round(predicted, 2), round(measured, 2), round(load, 2))
        per_step[eta] = [(round(m["timing/step_s"], 3), *(round(t, 3) for t in stage_times(m))) for m in steps]
        assert sim.lag_max == max(m["async/lag_max"] for m in steps) == eta
    return report, per_step


def within(report: dict) -> bool:
    """Every run's measured samples/s within 15 % of the prediction."""
    return all(abs(predicted - measured) <= 0.15 * measured for predicted, measured, _ in report.values())


def test_the_simulator_fitted_from_one_run_predicts_the_others(
    tmp_path: Path, tiny_model_dir: Path, prefect_harness, ray_session
) -> None:
    """A miss is run again once, all three runs: a load spike of the shared machine during one run (2026-12-03,
    CI on a Zen 4 EPYC: the eta-1 run at 107 samples/s against 144-157 in the other attempts) is not the
    simulator's error; both attempts' reports are in the message."""
    attempts = [eta_report(tmp_path, tiny_model_dir, 0)]
    if not within(attempts[0][0]):
        attempts.append(eta_report(tmp_path, tiny_model_dir, 1))
    report, per_step = attempts[-1]
    print("eta: (predicted, measured, load)", [a[0] for a in attempts])  # noqa: T201  # read with -s
    # (predicted, measured, load) by eta; each step's (step_s, generate, train, sync) to tell which moved
    assert within(report), ([a[0] for a in attempts], per_step)
    assert report[1][0] > 1.2 * report[0][0], report  # the overlap the simulator predicts is there to predict


SPLITS = (1, 2, 3)  # rollout workers beside the one trainer
CAP = 0.4  # of a CPU, each worker process (three rollout workers and the trainer: 1.6 of the two cores)
SPLIT_TOKENS = 192  # long replies: at 1:1 the generation, not the trainer, sets the pace


@pytest.mark.skipif(not CpuCaps.available(), reason="the split runs cap each worker's CPU by cgroup: needs root")
def test_the_simulator_fitted_from_one_split_predicts_two_others(
    tmp_path: Path, tiny_model_dir: Path, prefect_harness, ray_session
) -> None:
    """Three real async runs (eta 1) at rollout:trainer splits 1:1, 2:1 and 3:1, every Ray worker held to 0.4 of a
    CPU (`cpu_caps.CpuCaps`: equal devices that do not share cores). The simulator is fitted from the 1:1 run plus
    the rollout engine's generation time at the three splits' batch sizes (`async_sim.probe.batch_times`: a run sees
    one batch size per worker, so it cannot tell how a step's cost falls with fewer rows) and predicts each run's
    samples/s, compared as the eta test compares them. Within 15 %."""
    runs = {}
    with CpuCaps(CAP):
        for n in SPLITS:
            cfg = tiny_cfg(tmp_path, tiny_model_dir, f"split{n}", *RUN, "trainer.async.max_staleness=1",
                           f"rollout.num_workers={n}", f"rollout.max_new_tokens={SPLIT_TOKENS}")  # fmt: skip
            rl_post_train(cfg)
            runs[n] = (cfg, recorded_steps(cfg))
    cfg1, steps1 = runs[1]
    shapes = {n: run_shape(cfg) for n, (cfg, _) in runs.items()}
    rows = {n: shape.rows_per_worker for n, shape in shapes.items()}
    sampling = SamplingParams(n=cfg1.rollout.n, max_new_tokens=cfg1.rollout.max_new_tokens)
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(cfg1.data.prompts_per_step)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs
    try:
        engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
        times = batch_times(engine, prompts, sampling, sorted(set(rows.values()), reverse=True))
    finally:
        torch.set_num_threads(threads)
    share = memory_bound_share(times, rows[1])
    profile = fit_profile(steps1, shapes[1], memory_bound_share=share)
    samples = shapes[1].groups_per_step * shapes[1].samples_per_group
    report = {}
    for n, (_, steps) in runs.items():
        assert shapes[n].rollout_workers == n and len(steps) == STEPS
        sim = simulate(profile, SimConfig(shapes[n].groups_per_step, shapes[n].samples_per_group, 1, STEPS, n))
        load = trainer_busy_s(steps) / trainer_busy_s(steps1)
        measured = measured_samples_per_s(steps, samples) * load
        report[n] = (round(sim.steady_samples_per_s(samples), 2), round(measured, 2), round(load, 2))
        assert max(m["async/lag_max"] for m in steps) <= 1
    print("split: (predicted, measured, load)", report, "share", round(share, 2), times)  # noqa: T201  # read with -s
    for predicted, measured, _ in report.values():
        assert abs(predicted - measured) <= 0.15 * measured, (report, share, times)
