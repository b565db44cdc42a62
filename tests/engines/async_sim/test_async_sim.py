"""The simulator of asynchronous training (engines/async_sim): its invariants on long-tailed random latencies (max
lag <= eta, every sample trained once), eta 0 is the synchronous schedule exactly, determinism, partial rollouts'
mixed versions, and the fits (a GPU profile reproduces its generation time; a recorded run's metrics give back the
latencies they were made from)."""

from __future__ import annotations

import random

import pytest

from rlstages.engines.async_sim.fit import RunShape, fit_profile
from rlstages.engines.async_sim.profile import EngineProfile, LengthModel, batch_decode_s, gpu_profile
from rlstages.engines.async_sim.sim import SimConfig, simulate

TAIL = LengthModel(mean=40, cap=256, sigma=1.0)  # long-tailed replies
PROFILE = EngineProfile(TAIL, decode_s=0.01, decode_row_s=0.002, prefill_s=0.003, train_step_s=1.5,
                        train_token_s=0.0005, sync_s=0.2)  # fmt: skip


@pytest.mark.parametrize(("stream", "partial"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_lag_bounded_and_every_sample_trained_once(eta: int, stream: bool, partial: bool) -> None:
    for seed in range(3):
        workers = 1 + seed
        cfg = SimConfig(4, 3, eta, 7, rollout_workers=workers, stream=stream, partial_rollout=partial,
                        slots=9 if stream else None, seed=seed)  # fmt: skip
        result = simulate(PROFILE, cfg)
        assert result.lag_max <= eta and 0 <= result.lag_mean <= result.lag_max
        trained = [g for step in result.trained for g in step]
        assert trained == list(range(7 * 4))  # in admission order, each group once, none lost
        assert sorted(result.generated) == trained  # generated once each (finishing in any order)
        assert all(len(step) == 4 for step in result.trained)
        assert result.queue_depth_max <= (eta + 1) * 4
        assert 0 <= result.rollout_idle_fraction <= 1 and 0 <= result.trainer_idle_fraction <= 1


def test_eta_0_is_the_synchronous_schedule() -> None:
    """eta 0: each step generates (its rows spread over the workers, the slowest worker's batch), trains, syncs;
    the simulated time is that sum exactly, with the same lengths drawn in the same order."""
    steps, groups, n, workers = 5, 4, 3, 2
    result = simulate(PROFILE, SimConfig(groups, n, 0, steps, rollout_workers=workers, seed=7))
    rng, total = random.Random(7), 0.0
    for _ in range(steps):
        per_worker: list[list[int]] = [[] for _ in range(workers)]
        for g in range(groups):
            per_worker[g % workers].extend(TAIL.sample(rng) for _ in range(n))
        generate = max(batch_decode_s(PROFILE, rows) for rows in per_worker)
        total += generate + PROFILE.train_s(sum(map(sum, per_worker))) + PROFILE.sync_s
    assert result.time_s == pytest.approx(total, rel=1e-9)
    assert result.samples_per_s == pytest.approx(steps * groups * n / total, rel=1e-9)
    assert result.lag_max == 0.0


def test_overlap_and_determinism() -> None:
    """Generation as long as the update: eta 1 overlaps them (close to twice the samples/s, lag 1 on most tokens),
    and a seed gives the same run."""
    flat = EngineProfile(LengthModel(50, 50, 0.0), 0.02, 0.0, 0.0, 1.0, 0.0, 0.0)
    sync = simulate(flat, SimConfig(2, 2, 0, 20)).samples_per_s
    overlapped = simulate(flat, SimConfig(2, 2, 1, 20))
    assert overlapped.samples_per_s == pytest.approx(2 * sync, rel=0.06)
    assert overlapped.lag_mean > 0.9
    a, b = (simulate(PROFILE, SimConfig(4, 3, 2, 6, 2, True, True, 6, seed=3)) for _ in range(2))
    assert a.summary() == b.summary() and a.trained == b.trained and a.generated == b.generated


def test_partial_rollouts_mix_versions_and_keep_the_bound() -> None:
    """With partial rollouts a sync lands in the middle of long replies: the batch's tokens come from two
    versions (lag mean strictly between whole numbers) and the max stays within eta."""
    result = simulate(PROFILE, SimConfig(4, 3, 1, 8, 1, stream=True, partial_rollout=True, slots=6, seed=1))
    assert result.lag_max <= 1 and 0 < result.lag_mean < 1 and result.interrupted > 0
    whole = simulate(PROFILE, SimConfig(4, 3, 1, 8, 1, stream=True, partial_rollout=False, slots=6, seed=1))
    assert whole.interrupted == 0  # without them a sync waits for the rows in flight


def test_gpu_profile_reproduces_its_generation_time() -> None:
    """verl's Qwen2-7B row (generation 60 s of 120 s): the fitted worker's batch takes ~60 s, the trainer the rest."""
    lengths = LengthModel(512, 1024, 0.8)
    profile = gpu_profile(60.0, 120.0, rows_per_worker=320, lengths=lengths, sync_s=3.0)
    rng = random.Random(11)
    mean = sum(batch_decode_s(profile, [lengths.sample(rng) for _ in range(320)]) for _ in range(8)) / 8
    assert mean == pytest.approx(60.0, rel=0.05)
    assert profile.train_step_s == pytest.approx(57.0)
    with pytest.raises(ValueError, match="step_s"):
        gpu_profile(130.0, 120.0, 320, lengths, 3.0)


def test_fit_from_recorded_metrics() -> None:
    """Per-step metrics as a run logs them: the fit gets the generation, trainer and sync times back."""
    steps = [
        {"rollout/generate_wall_s": 9.0 if s == 0 else 2.0, "timing/update_actor_s": 1.0,
         "timing/actor_logprobs_s": 0.5, "timing/wait_rollout_s": 3.0, "timing/sync_weights_s": 0.25,
         "timing/step_s": 4.0, "response_length/mean": 6.0, "response_length/max": 6.0}
        for s in range(4)
    ]  # fmt: skip
    shape = RunShape(4, 4, 8, 2)
    profile = fit_profile(steps, shape)  # the first step (warm-up, 9 s) left out
    assert (profile.train_step_s, profile.sync_s, profile.lengths.sigma) == (1.5, 0.25, 0.0)
    assert batch_decode_s(profile, [6] * shape.rows_per_worker) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="generation time"):
        fit_profile([{"timing/step_s": 1.0}], shape)
