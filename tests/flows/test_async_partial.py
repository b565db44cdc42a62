"""`trainer.async.partial_rollout: true` through the real flow (tiny preset, 3 steps, eta 1, engines in the driver;
real Prefect and MLflow): prompt groups stream through 4 slots, the sync interrupts the rows in flight and they
continue under the new weights, so step 3's trajectories carry two versions; every token lags at most eta, every
step trains on what was generated for it, once; the versions file is the batch's own field; on Ray, a rollout
worker killed mid-stream is restarted in place. CPU, seconds (Ray: a minute or more).

Which token a sync lands on depends on timing; to make the interruption certain, the engine's `pump` holds step
3's rows (after they have sampled a token under version 1) until the sync to version 2 has happened -- it only
waits, it decodes nothing differently."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from flow_support import IN_DRIVER, run_dir, tiny_cfg
from safetensors.torch import load_file
from test_async_flow import history, rollouts, schedule_events, taken_once

from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.async_schedule import ScheduleError, read_schedule
from rlstages.tasks.driver.async_stream import mixed_rows

RUN = ("cluster.hybrid_engine=false", "trainer.total_steps=3", "trainer.eval_every=0", "trainer.eval_at_start=false",
       "checkpoint.every=0", IN_DRIVER, "trainer.mode=async", "trainer.async.max_staleness=1",
       "trainer.async.partial_rollout=true", "rollout.batch_size=4")  # fmt: skip


def test_partial_rollouts_mix_versions_within_eta(tmp_path: Path, tiny_model_dir: Path, prefect_harness,
                                                  monkeypatch) -> None:  # fmt: skip
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "partial", *RUN)
    b = cfg.data.prompts_per_step
    pump = HFRolloutEngine.pump

    def held_pump(self: HFRolloutEngine, max_steps: int = 1) -> list:
        live = self._stream.decoder.rows if self._stream is not None else []
        step3 = live and all(row.key[0] >= 2 * b for row in live)
        if step3 and self.policy_version < 2 and any(row.ids for row in live):
            time.sleep(0.02)  # step 3's rows have begun under version 1: wait for the next sync
            return []
        return pump(self, max_steps)

    monkeypatch.setattr(HFRolloutEngine, "pump", held_pump)
    rl_post_train(cfg)
    tokens = history(cfg, "async/tokens")
    assert sorted(tokens) == [1, 2, 3] and sorted(history(cfg, "reward/mean")) == [1, 2, 3]
    for step, n in tokens.items():  # each step trained on what was generated for it, every token once
        assert n == float(rollouts(cfg, step)["response_mask"].sum()), step
    assert max(history(cfg, "async/lag_max").values()) <= 1.0  # checked by the queue at every batch, too
    for step in (1, 2, 3):
        batch = rollouts(cfg, step)
        versions = load_file(str(run_dir(cfg) / "steps" / f"{step:06d}" / "versions.safetensors"))
        assert versions["rollout_versions"].equal(batch["rollout_versions"])  # one source: the engine's stamps
        mask = batch["response_mask"] > 0
        assert not batch["rollout_versions"][~mask].any()
        used = set(batch["rollout_versions"][mask].tolist())
        assert used <= {max(0, step - 2), step - 1}, (step, used)  # within eta of the trainer's version step - 1
    last = rollouts(cfg, 3)
    mixed = mixed_rows(last["rollout_versions"], last["response_mask"])
    assert mixed >= 1  # trajectories spanning the sync to version 2 carry versions 1 and 2
    assert history(cfg, "async/mixed_version_sequences")[3] == float(mixed)
    assert history(cfg, "async/interrupted_sequences")[3] >= mixed
    assert history(cfg, "async/lag_max")[3] == 1.0 and history(cfg, "async/lag_hist/0")[3] > 0.0
    for key in ("async/trainer_idle_fraction", "async/rollout_idle_fraction"):
        assert all(0.0 <= v <= 1.0 for v in history(cfg, key).values()), key


def test_partial_rollouts_on_ray_workers(tmp_path: Path, tiny_model_dir: Path, ray_session, prefect_harness,
                                        monkeypatch) -> None:  # fmt: skip
    """The same on Ray (rollout engines in their own actors, the queue an actor), with the rollout worker killed as
    step 3's first group enters its stream (during step 2, beside step 2's unfinished rows): a fresh worker takes
    its place with the trainer's weights and the groups it had in flight are submitted again -- no recovery from a
    checkpoint (there is none), their tokens regenerated under the fresh worker's version. Every step trained once
    on what was generated for it, every sample once, lags within eta, the versions file is the batch's own field;
    the run is refused by replay (a death's timing cannot be reproduced)."""
    monkeypatch.setenv("RLSTAGES_FAULTS", "generate@3:kill-rollout")
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "partial-ray", *(r for r in RUN if r != IN_DRIVER))
    assert cfg.cluster.mode == "ray"
    rl_post_train(cfg)
    assert (run_dir(cfg) / ".faults" / "generate@3-kill-rollout").exists()  # the fault fired
    tokens = history(cfg, "async/tokens")
    assert sorted(tokens) == [1, 2, 3]
    for step, n in tokens.items():
        batch = rollouts(cfg, step)
        assert n == float(batch["response_mask"].sum()), step
        versions = load_file(str(run_dir(cfg) / "steps" / f"{step:06d}" / "versions.safetensors"))
        assert versions["rollout_versions"].equal(batch["rollout_versions"])
        assert batch["rollout_versions"].max().item() <= step - 1
    assert max(history(cfg, "async/lag_max").values()) <= 1.0
    events = schedule_events(cfg)
    (restart,) = [e for e in events if e["kind"] == "restart"]  # restarted in place, once
    assert [e["kind"] for e in events].count("start") == 1 and restart["resubmitted"]  # no recovery; it had work
    for take in taken_once(cfg, 1):  # every sample once; the resubmitted groups' tokens regenerated, not kept
        for (g, _), row in zip(take["samples"], take["versions"], strict=True):
            assert g not in restart["resubmitted"] or all(v >= restart["version"] for v, _ in row), g
    with pytest.raises(ScheduleError, match="line .*restarted"):
        read_schedule(run_dir(cfg) / "schedule.jsonl")
