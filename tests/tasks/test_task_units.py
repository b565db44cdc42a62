"""Unit tests of the task layer without Ray or a flow run: the advantage stage on hand-made batches, retry
classification and back-off, worker-death translation and stage seeds. Each runs in well under a second, so a
mistake in tasks/ fails here before the minutes-long flow tests. CPU only.
Run: pytest tests/tasks/test_task_units.py
"""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prefect.states import Completed, Failed

from rlstages.configs import load_config
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.tasks.advantage import advantages, initial_kl_state
from rlstages.tasks.driver.context import RunHandle, derive_seed
from rlstages.tasks.policies import (
    WorkerLost,
    backoff_delays,
    guard_workers,
    is_transient,
    is_worker_death,
    retry_condition,
)

ROOT = Path(__file__).resolve().parents[2]


def config(tmp: Path, *overrides: str):
    return load_config(
        ROOT / "configs" / "tiny.yaml", [f"trainer.output_dir={tmp}", "model.provider=local", *overrides]
    )


def write_step(run: RunHandle, step: int, scores: list[float], uids: list[str], lengths: list[int]) -> None:
    """A rollout batch (response mask of the given lengths) and its scores, as the earlier stages write them."""
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    rollout = T.make_batch(
        {
            T.RESPONSE_MASK: mask,
            T.RESPONSE_IDS: torch.ones(len(lengths), width, dtype=torch.long),
            T.ROLLOUT_LOGPROBS: torch.zeros(len(lengths), width),
        },
        {"uid": uids},
    )
    run.step_dir(step).mkdir(parents=True, exist_ok=True)
    T.save_batch(rollout, run.batch(step, "rollout"))
    T.save_batch(T.make_batch({T.SCORES: torch.tensor(scores)}, {}), run.batch(step, "scores"))


def test_advantage_stage_matches_the_estimator(tmp_path: Path) -> None:
    cfg = config(tmp_path, "algorithm.adv_estimator=grpo", "algorithm.filter_groups=false")
    run = RunHandle("units", str(tmp_path / "run"))
    scores, uids, lengths = [1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], [3, 2, 4, 1]
    write_step(run, 1, scores, uids, lengths)
    out = advantages.fn(cfg, run, 1, initial_kl_state(cfg))
    train = T.load_batch(run.batch(1, "train"))
    mask = train[T.RESPONSE_MASK]
    token_rewards = A.outcome_to_token_rewards(torch.tensor(scores), mask)
    expected, _ = A.compute_grpo(token_rewards, mask, uids, norm_by_std=cfg.algorithm.norm_adv_by_std)
    torch.testing.assert_close(train[T.ADVANTAGES], expected)
    assert train[T.ADVANTAGES][0, 0] > 0 > train[T.ADVANTAGES][1, 0]  # the right answer of group a is favoured
    assert train[T.ADVANTAGES][2:].abs().max() == 0  # group b is all-correct: no signal
    assert out.metrics["batch/kept_fraction"] == 1.0
    assert out.kl_state == initial_kl_state(cfg)  # no KL in reward: the controller is untouched


def test_advantage_stage_filters_constant_groups(tmp_path: Path) -> None:
    cfg = config(tmp_path, "algorithm.adv_estimator=grpo", "algorithm.filter_groups=true")
    run = RunHandle("units", str(tmp_path / "run"))
    write_step(run, 2, [1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], [3, 2, 4, 1])
    out = advantages.fn(cfg, run, 2, initial_kl_state(cfg))
    train = T.load_batch(run.batch(2, "train"))
    assert T.get_rows(train, "uid") == ["a", "a"]
    assert out.metrics["batch/kept_fraction"] == 0.5


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (TimeoutError("slow"), True),
        (ConnectionResetError("reset"), True),
        (OSError(errno.EIO, "io"), True),
        (OSError(errno.ENOSPC, "disk full"), False),
        (ValueError("bad shape"), False),
        (KeyError("x"), False),
        (FileNotFoundError("gone"), False),
        (WorkerLost("dead"), False),
        (type("GetTimeoutError", (Exception,), {})(), True),
        (type("ObjectLostError", (Exception,), {})(), True),
        (RuntimeError("programming error"), False),
    ],
)
def test_retry_classification(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_ray_task_error_is_classified_by_its_cause() -> None:
    wrapper = type("RayTaskError", (Exception,), {})()
    wrapper.cause = TimeoutError("inside the worker")
    assert is_transient(wrapper)
    wrapper.cause = ValueError("inside the worker")
    assert not is_transient(wrapper)


def test_retry_condition_reads_the_prefect_state() -> None:
    run = SimpleNamespace(name="generate[step=1]")
    assert retry_condition(None, run, Failed(data=TimeoutError("t")))
    assert not retry_condition(None, run, Failed(data=ValueError("v")))
    assert not retry_condition(None, run, Completed(data=1))


def test_backoff_grows_geometrically(tmp_path: Path) -> None:
    policy = (
        config(tmp_path)
        .prefect.policy("generate")
        .model_copy(update={"retries": 3, "retry_delay_seconds": 2.0, "backoff_factor": 3.0})
    )
    assert backoff_delays(policy) == [2.0, 6.0, 18.0]
    assert backoff_delays(policy.model_copy(update={"retries": 0})) == []


def test_a_dead_actor_becomes_worker_lost_and_other_errors_pass_through() -> None:
    died = type("ActorDiedError", (Exception,), {})
    assert is_worker_death(died())

    def dies() -> None:
        raise died("the actor's process is gone")

    with pytest.raises(WorkerLost):
        guard_workers(dies)
    with pytest.raises(ValueError):
        guard_workers(lambda: (_ for _ in ()).throw(ValueError("a real bug")))
    assert guard_workers(lambda: 7) == 7


def test_stage_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(1, 5, "generate") == derive_seed(1, 5, "generate")
    seeds = {derive_seed(s, step, stage) for s in (0, 1) for step in (1, 2) for stage in ("generate", "eval")}
    assert len(seeds) == 8


def test_engine_perf_metrics_are_named_per_role_and_memory_peaks_take_the_largest_rank() -> None:
    from rlstages.tasks.update import _across_ranks, _name

    assert _name("actor", "perf/mfu") == "perf/mfu/actor" and _name("critic", "pg_loss") == "critic/pg_loss"
    assert _across_ranks("perf/max_memory_allocated_gb", [1.0, 3.0]) == 3.0
    assert _across_ranks("perf/throughput", [1.0, 3.0]) == 2.0 and _across_ranks("pg_loss", [1.0, 3.0]) == 2.0


def test_a_storage_failure_at_the_commits_fsync_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A full disk that first says so at the commit's fsync (delayed allocation): the staged step is dropped, one
    line says so, and the committed step before it stays the newest and verifies."""
    from rlstages.tasks import checkpoint as C
    from rlstages.tasks.driver.checkpoints import latest_checkpoint

    cfg = config(tmp_path, "checkpoint.keep=2")
    run = RunHandle("commits", str(tmp_path / "run"))

    def stage(step: int) -> None:
        tmp = C.staging_dir(run, step)
        (tmp / "actor").mkdir(parents=True)
        (tmp / "actor" / "model.safetensors").write_bytes(bytes([step]) * 64)

    stage(1)
    C.commit_checkpoint.fn(cfg, run, 1, {"kl_state": {}})
    stage(2)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C.os, "fsync", full)
    with pytest.raises(OSError, match=r"^\[Errno 28\] checkpoint step 2 not committed \(No space left on device\); "):
        C.commit_checkpoint.fn(cfg, run, 2, {"kl_state": {}})
    monkeypatch.undo()
    assert not C.staging_dir(run, 2).exists() and not C.checkpoint_dir(run, 2).exists()
    found = latest_checkpoint(run, verify=True)
    assert found is not None and found[0] == 1
