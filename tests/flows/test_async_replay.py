"""`rlstages replay` (issue 52) through the real flow (tiny preset, 3 steps, engines in the driver; real Prefect,
MLflow and safetensors): an async run records its schedule (samples per update, per-token versions, interrupt
points, weight syncs, seeds); replaying it on the virtual clock gives the same final weights bit for bit, every
logged metric equal (wall-clock ones excluded) and the same schedule, line by line; a tampered schedule is refused
in one line naming the file and the entry. CPU, a minute or two."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from flow_support import IN_DRIVER, invoke, mlflow_run, run_dir, tiny_cfg

from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.async_replay import ReplayClock, ReplayDiverged
from rlstages.tasks.driver.async_schedule import SCHEDULE, ScheduleError
from rlstages.tasks.driver.replay_check import differences, replay_config

RUN = ("cluster.hybrid_engine=false", "trainer.total_steps=3", "trainer.eval_every=0", "trainer.eval_at_start=false",
       "checkpoint.every=0", IN_DRIVER, "trainer.mode=async")  # fmt: skip
PARTIAL = ("trainer.async.max_staleness=1", "trainer.async.partial_rollout=true", "rollout.batch_size=4")


def events(path: Path) -> list[dict]:
    """A schedule file's events."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def hold_step3_for_sync2(monkeypatch: pytest.MonkeyPatch, groups_per_step: int) -> None:
    """Make an interruption certain (as tests/flows/test_async_partial.py does): step 3's rows, once they have a
    token under version 1, wait (pumps that decode nothing) until the sync to version 2. The decision reads only
    the engine's state, so the replay, pumping at the recorded turns, holds at the same calls."""
    pump = HFRolloutEngine.pump

    def held_pump(self: HFRolloutEngine, max_steps: int = 1) -> list:
        live = self._stream.decoder.rows if self._stream is not None else []
        step3 = live and all(row.key[0] >= 2 * groups_per_step for row in live)
        if step3 and self.policy_version < 2 and any(row.ids for row in live):
            time.sleep(0.02)
            return []
        return pump(self, max_steps)

    monkeypatch.setattr(HFRolloutEngine, "pump", held_pump)


@pytest.mark.parametrize(
    "extra",
    [("trainer.async.max_staleness=2",), PARTIAL],  # whole-step generation at eta 2; eta 1 with partial rollouts
    ids=["eta2", "eta1-partial"],
)
def test_a_recorded_async_run_replays_bitwise(
    extra: tuple[str, ...], tmp_path: Path, tiny_model_dir: Path, prefect_harness, monkeypatch
) -> None:
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "live", *RUN, *extra)
    partial = cfg.trainer.async_.partial_rollout
    if partial:
        hold_step3_for_sync2(monkeypatch, cfg.data.prompts_per_step)
    rl_post_train(cfg)
    recorded = events(run_dir(cfg) / SCHEDULE)
    kinds = [e["kind"] for e in recorded]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("take") == 3 and kinds.count("sync") == 3
    b, n = cfg.data.prompts_per_step, cfg.rollout.n
    takes = [e for e in recorded if e["kind"] == "take"]
    assert [len(e["samples"]) for e in takes] == [b * n] * 3 and takes[2]["samples"][0] == [2 * b, 0]
    assert all(sum(c for _, c in runs) > 0 for e in takes for runs in e["versions"])
    if partial:  # rows interrupted by sync 2 (recorded with their token counts) carry versions 1 then 2
        interrupted = next(e for e in recorded if e["kind"] == "sync" and e["version"] == 2)["in_flight"]
        assert interrupted and all(tokens > 0 for _, _, tokens in interrupted)
        assert any([v for v, _ in runs] == [1, 2] for runs in takes[2]["versions"])
        assert "pump" in kinds
    replay = replay_config(run_dir(cfg))
    rl_post_train(replay)
    diffs, tensors, metrics = differences(cfg, run_dir(cfg), run_dir(replay))
    assert diffs == [] and tensors > 0 and metrics > 20
    assert events(run_dir(replay) / SCHEDULE) == recorded


def test_a_tampered_schedule_is_refused(tmp_path: Path, tiny_model_dir: Path, prefect_harness) -> None:
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "tampered", *RUN, "trainer.total_steps=2")
    rl_post_train(cfg)
    client, run = mlflow_run(cfg)  # the schedule is in MLflow too
    assert [a.path for a in client.list_artifacts(run.info.run_id, "async")] == [f"async/{SCHEDULE}"]
    path = run_dir(cfg) / SCHEDULE
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "take")
    take = json.loads(lines[at])
    gone = take["samples"].pop(1)
    take["versions"].pop(1)
    lines[at] = json.dumps(take)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ScheduleError) as refused:
        replay_config(run_dir(cfg))
    line = str(refused.value)
    assert "\n" not in line and str(path) in line and f"line {at + 1}" in line and f"sample {gone}" in line
    out = invoke("replay", str(run_dir(cfg)), cwd=tmp_path)  # the command: the same line, exit 2, nothing started
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.exit_code == 2 and len(lines) == 1 and f"sample {gone}" in lines[0], out.stderr
    assert not (run_dir(cfg).parent / "tampered-replay").exists()


def test_the_clock_imposes_the_recorded_order(tmp_path: Path) -> None:
    """Turns come in the recorded order whatever the threads' timing; a replayed event that differs is refused
    naming the line; a non-bitwise engine's replay compares the schedule without token counts."""
    path = tmp_path / SCHEDULE
    recorded = [
        {"seq": 0, "kind": "put", "actor": "rollout", "step": 1},
        {"seq": 1, "kind": "take", "actor": "trainer", "step": 1, "versions": [[[0, 5]]]},
    ]
    clock = ReplayClock(path, recorded)
    with pytest.raises(ReplayDiverged, match="did a 'sync' where the schedule has line 2 \\(take\\)"):
        with clock.turn("trainer", "sync"):
            pass
    order: list[str] = []

    def take() -> None:
        with clock.turn("trainer", "take"):
            order.append("take")

    trainer = threading.Thread(target=take)
    trainer.start()  # waits: the rollout's put comes first
    time.sleep(0.1)
    assert order == []
    with clock.turn("rollout", "put"):
        order.append("put")
    trainer.join(5)
    assert order == ["put", "take"]
    other = {**recorded[1], "versions": [[[0, 6]]]}
    with pytest.raises(ReplayDiverged, match=f"{path} line 2: the replay wrote take"):
        clock.expect(other)
    ReplayClock(path, recorded, bitwise=False).expect(other)  # vLLM: same versions, other lengths: accepted
    with pytest.raises(ReplayDiverged):
        ReplayClock(path, recorded, bitwise=False).expect({**other, "versions": [[[1, 6]]]})
