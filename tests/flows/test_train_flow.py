"""The training flow end to end on a tiny random model with real Prefect (no server), real Ray and a
real MLflow SQLite store: 2 steps learn and are recorded; a transient stage fault is retried; a crash is
resumed bitwise into the same MLflow run; a killed worker is recovered from the last checkpoint, also while a
checkpoint's commit fails beside it (as a failing stage's run is resumed: the commit never relabels it). The retry and
resume runs put the engines in the driver (`cluster.mode=in_process`, `IN_DRIVER`) and still end bit for bit
where the Ray run ends: the two modes run the same engines.
CPU only, ~3 minutes: `pytest tests/flows/test_train_flow.py`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from flow_support import IN_DRIVER, Reference, final_weights, mlflow_run, tiny_cfg
from mlflow import MlflowClient
from safetensors.torch import load_file

from rlstages.configs import RunConfig
from rlstages.flows.console import summary_rows
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.checkpoints import latest_checkpoint
from rlstages.tasks.driver.context import RunHandle


@pytest.fixture
def base(reference_run: Reference, ray_session) -> tuple[Path, RunConfig, Path]:
    """The session's reference run (tests/flows/conftest.py): an uninterrupted 2-step run on Ray that every
    other test compares against (with the session's Ray, which this file's runs use)."""
    return reference_run.tmp, reference_run.cfg, reference_run.policy


@pytest.fixture
def faults(monkeypatch):
    def set_faults(spec: str) -> None:
        monkeypatch.setenv("RLSTAGES_FAULTS", spec)

    return set_faults


def test_two_steps_learn_and_are_recorded(base, tiny_model_dir: Path) -> None:
    tmp, cfg, policy = base
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    final = final_weights(cfg)
    assert sum(not torch.equal(initial[k], final[k]) for k in initial) == len(initial)  # parameters changed
    client, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"
    assert run.data.params["actor.optim.lr"] == "0.001" and run.data.params["rollout.n"] == "4"
    assert run.data.tags["rlstages.algorithm"] == "grpo" and run.data.tags["rlstages.config_hash"]
    for key in (
        "reward/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "timing/generate_s",
        "rollout/logprob_diff",
        "throughput/tokens_per_s",
        "perf/throughput/actor",  # the engine's perf/* metrics reach MLflow named per role
        "perf/compile_s/actor",  # the update's compiling, left out of the ETA
    ):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == [1, 2], key
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff")) < 1e-4
    assert not client.get_metric_history(run.info.run_id, "perf/mfu/actor")  # no peak known for a CPU: no MFU
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/reward_mean")] == [0, 1, 2]
    evals = client.get_metric_history(run.info.run_id, "time/eval_s")  # each evaluation's wall time, logging too
    assert [m.step for m in evals] == [0, 1, 2] and all(m.value > 0 for m in evals)
    share = {
        k: client.get_metric_history(run.info.run_id, f"time/{k}") for k in ("eval_total_s", "run_s", "eval_fraction")
    }
    assert [m.step for m in share["eval_fraction"]] == [2]  # the run's evaluation share, at its end
    total, run_s = share["eval_total_s"][0].value, share["run_s"][0].value
    assert total == pytest.approx(sum(m.value for m in evals)) and 0 < total < run_s
    assert share["eval_fraction"][0].value == pytest.approx(total / run_s)
    shown = dict(summary_rows(cfg, str(policy), 60.0))["evaluation time"]
    assert shown.startswith("3 evaluations") and f"{100 * total / run_s:.1f} % of the run" in shown, shown
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert {"checkpoints/step_000001", "checkpoints/step_000002"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} == {"plots/reward_curve.png"}
    found = latest_checkpoint(RunHandle("base", str(policy.parent)), verify=True)
    assert found is not None and found[0] == 2
    assert (policy / "config.json").is_file() and (policy / "tokenizer.json").is_file()
    models = client.search_logged_models([run.info.experiment_id])
    assert ("policy", run.info.run_id) in [(m.name, m.source_run_id) for m in models]  # the MLflow model
    tags = run.data.tags
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"] and tags["mlflow.source.name"]
    assert tags["mlflow.source.git.commit"] == tags["rlstages.git_commit"]


def test_registry_aliases_mark_the_final_and_the_best_checkpoint(base) -> None:
    _, cfg, _ = base
    client, run = mlflow_run(cfg)
    rewards = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "eval/reward_mean")}
    best_step = max((1, 2), key=lambda s: (rewards[s], s))  # the checkpoints kept: steps 1 and 2
    final = client.get_model_version_by_alias("tiny-policy", "final")
    best = client.get_model_version_by_alias("tiny-policy", "best")
    assert final.run_id == best.run_id == run.info.run_id
    assert (best.version == final.version) == (best_step == 2)
    logged = {m.name: m for m in client.search_logged_models([run.info.experiment_id])}
    assert set(logged) == ({"policy"} if best_step == 2 else {"policy", "best_policy"})


def test_task_runs_are_named_by_stage_and_step(base) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def names() -> tuple[list[str], list[str]]:
        async with get_client() as client:
            flows = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["base"])))
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flows[0].id]}))
            return [f.name for f in flows], [t.name for t in tasks]

    import asyncio
    import time

    # the temporary server records task runs from their events in batches, at most 1 s late
    deadline = time.monotonic() + 15
    while True:
        flow_names, task_names = asyncio.run(names())
        if "export_policy" in task_names or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert flow_names == ["base"]  # the flow run is named after the training run
    for stage in ("generate", "score_rewards", "advantages", "update_actor", "sync_weights", "checkpoint"):
        assert {f"{stage}[step=1]", f"{stage}[step=2]"} <= set(task_names), (stage, sorted(task_names))
    assert "evaluate[step=0]" in task_names and "export_policy" in task_names


def test_transient_fault_is_retried(base, tiny_model_dir: Path, faults, tmp_path: Path) -> None:
    _, ref_cfg, _ = base
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "retried", IN_DRIVER)
    faults("generate@1:transient,score_rewards@2:transient")
    rl_post_train(cfg)
    run_dir = cfg.trainer.output_dir / "retried"
    assert (run_dir / ".faults" / "generate@1-transient").exists()
    reference, retried = final_weights(ref_cfg), final_weights(cfg)
    assert all(torch.equal(reference[k], retried[k]) for k in reference)
    _, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"


def test_crash_then_resume_is_bitwise_and_logs_each_step_once(
    base, tiny_model_dir: Path, faults, tmp_path: Path
) -> None:
    _, ref_cfg, _ = base
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "crashed", IN_DRIVER)
    faults("checkpoint@2:fatal")  # step 2's metrics are logged, then the run dies before committing it
    with pytest.raises(RuntimeError, match="injected fatal fault"):
        rl_post_train(cfg)
    client, run = mlflow_run(cfg)
    assert run.info.status == "FAILED" and run.data.tags["rlstages.failed_stage"] == "checkpoint"
    found = latest_checkpoint(RunHandle("crashed", str(cfg.trainer.output_dir / "crashed")))
    assert found is not None and found[0] == 1
    rl_post_train(cfg)  # the same config again: resumes from step 1 into the same MLflow run
    client, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
    reference, resumed = final_weights(ref_cfg), final_weights(cfg)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


def _task_runs(flow_run_name: str) -> dict[str, Any]:
    """The task runs of the flow run named so, by name, once the temporary server has recorded its export (task
    runs arrive from their events in batches, at most ~1 s late) with every end time."""
    import asyncio
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def read() -> dict[str, Any]:
        async with get_client() as client:
            name = FlowRunFilterName(any_=[flow_run_name])
            flows = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=name))
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flows[0].id]}))
            return {t.name: t for t in tasks}

    deadline = time.monotonic() + 15
    while True:
        runs = asyncio.run(read())
        done = "export_policy" in runs and all(t.end_time is not None for t in runs.values())
        if done or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


@pytest.mark.parametrize("background", [True, False])
def test_a_checkpoint_commits_beside_the_next_step(
    base, tiny_model_dir: Path, faults, tmp_path: Path, background: bool
) -> None:
    """Step 1's commit, held ~1 s by a transient fault after its rename and then retried (the retry writes the
    manifest from the renamed directory), runs while step 2 generates; with `commit_in_background=false` step 2
    waits for it. Either way the run ends as the reference did, its last checkpoint committed and verified."""
    _, ref_cfg, _ = base
    name = "beside" if background else "waits"
    cfg = tiny_cfg(tmp_path, tiny_model_dir, name, IN_DRIVER, f"checkpoint.commit_in_background={background}")
    faults("checkpoint_commit@1:transient")
    rl_post_train(cfg)
    run_dir = cfg.trainer.output_dir / name
    assert (run_dir / ".faults" / "checkpoint_commit@1-transient").exists()  # the retry after the rename ran
    found = latest_checkpoint(RunHandle(name, str(run_dir)), verify=True)
    assert found is not None and found[0] == 2
    reference, saved = final_weights(ref_cfg), final_weights(cfg)
    assert all(torch.equal(reference[k], saved[k]) for k in reference)
    runs = _task_runs(name)
    commit, generate = runs["commit_checkpoint[step=1]"], runs["generate[step=2]"]
    assert commit.end_time is not None and generate.start_time is not None, sorted(runs)
    if background:
        assert generate.start_time < commit.end_time  # step 2 did not wait for step 1's commit
    else:
        assert commit.end_time <= generate.start_time


def test_killed_worker_is_rebuilt_and_replayed(base, tiny_model_dir: Path, faults, tmp_path: Path) -> None:
    _, ref_cfg, _ = base
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "killed")
    faults("update_actor@2:kill-actor")
    rl_post_train(cfg)
    reference, recovered = final_weights(ref_cfg), final_weights(cfg)
    assert all(torch.equal(reference[k], recovered[k]) for k in reference)
    client, run = mlflow_run(cfg)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]


def test_a_commit_failing_beside_a_lost_worker_replays_from_before_it(
    base, tiny_model_dir: Path, faults, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1's commit fails after its rename (no manifest) while step 2's update loses the actor: the recovery
    joins the commit (its failure logged, not raised), finds no committed checkpoint, and replays from the start;
    the run ends as the reference did, step 1's checkpoint committed again."""
    _, ref_cfg, _ = base
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "commit-lost")
    faults("checkpoint_commit@1:fatal,update_actor@2:kill-actor")
    with caplog.at_level("WARNING", logger="rlstages.flows.commits"):
        rl_post_train(cfg)
    run_dir = cfg.trainer.output_dir / "commit-lost"
    assert {p.name for p in (run_dir / ".faults").iterdir()} == {
        "checkpoint_commit@1-fatal",
        "update_actor@2-kill-actor",
    }
    assert any("a checkpoint's commit failed" in r.getMessage() for r in caplog.records), caplog.text
    reference, recovered = final_weights(ref_cfg), final_weights(cfg)
    assert all(torch.equal(reference[k], recovered[k]) for k in reference)
    found = latest_checkpoint(RunHandle("commit-lost", str(run_dir)), verify=True)
    assert found is not None and found[0] == 2
    client, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]


def test_a_commit_failing_beside_a_failing_stage_keeps_the_stages_error_and_resumes(
    base, tiny_model_dir: Path, faults, tmp_path: Path
) -> None:
    """Step 1's commit fails after its rename while step 2's generation fails fatally: the run fails with the
    stage's error and is labelled with that stage (not the commit's), nothing it committed is half-written, and
    the same config resumes (from the start: step 1 was never committed) to the reference's weights."""
    _, ref_cfg, _ = base
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "commit-stage", IN_DRIVER)
    faults("checkpoint_commit@1:fatal,generate@2:fatal")
    with pytest.raises(RuntimeError, match="injected fatal fault"):
        rl_post_train(cfg)
    run_dir = cfg.trainer.output_dir / "commit-stage"
    handle = RunHandle("commit-stage", str(run_dir))
    assert (run_dir / ".faults" / "checkpoint_commit@1-fatal").exists()
    assert (run_dir / "checkpoints" / "step_000001").is_dir()  # renamed, then the commit failed: no manifest
    assert latest_checkpoint(handle) is None  # so it does not exist for a resume
    _, run = mlflow_run(cfg)
    assert run.info.status == "FAILED" and run.data.tags["rlstages.failed_stage"] == "generate"
    faults("")
    rl_post_train(cfg)
    found = latest_checkpoint(handle, verify=True)
    assert found is not None and found[0] == 2
    reference, resumed = final_weights(ref_cfg), final_weights(cfg)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)
    _, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"


def test_a_different_config_for_an_existing_run_is_refused(base, tiny_model_dir: Path) -> None:
    tmp, _, _ = base
    cfg = tiny_cfg(tmp, tiny_model_dir, "base", "trainer.seed=7")
    with pytest.raises(ValueError, match="holds a run of another config"):
        rl_post_train(cfg)
    assert os.path.isdir(tmp / "runs" / "base" / "final")  # nothing overwritten


def test_a_failed_start_does_not_block_its_run_name(
    tmp_path: Path, tiny_model_dir: Path, faults, prefect_harness
) -> None:
    """A failure the pre-flight cannot know (the first stage of step 1 dies) leaves a run directory that
    committed nothing. The corrected config (another config hash) runs under the same trainer.run_name: the
    pre-flight says it starts over there, the failed start's leftovers go, MLflow keeps the FAILED start."""
    import json

    from rlstages.configs import config_hash
    from rlstages.tasks.driver.preflight import preflight

    quick = ("trainer.eval_at_start=false", "trainer.total_steps=1", IN_DRIVER)
    wrong = tiny_cfg(tmp_path, tiny_model_dir, "late", "rollout.temperature=0.5", *quick)
    faults("generate@1:fatal")
    assert preflight(wrong) == []
    with pytest.raises(RuntimeError, match="injected fatal fault"):
        rl_post_train(wrong)
    run_dir = tmp_path / "runs" / "late"
    assert (run_dir / "config.yaml").is_file() and (run_dir / ".faults" / "generate@1-fatal").exists()
    faults("")
    fixed = tiny_cfg(tmp_path, tiny_model_dir, "late", *quick)
    assert config_hash(fixed) != config_hash(wrong)
    assert [w for w in preflight(fixed) if "holds a run that committed nothing" in w]  # was: refused
    policy = Path(rl_post_train(fixed))
    assert policy == run_dir / "final" and (policy / "model.safetensors").is_file()
    assert not (run_dir / ".faults").exists()  # the failed start's leftovers were cleared first
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["config_hash"] == config_hash(fixed) and state["status"] == "FINISHED"
    client = MlflowClient(fixed.tracking.tracking_uri)
    exp = client.get_experiment_by_name(fixed.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'late'")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]
    finished = next(r for r in runs if r.info.status == "FINISHED")
    assert finished.info.run_id == state["mlflow_run_id"]
    assert finished.data.tags["rlstages.config_hash"] == config_hash(fixed)


def test_hybrid_engine_gives_the_same_run(base, tiny_model_dir: Path, tmp_path: Path) -> None:
    _, ref_cfg, _ = base
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "hybrid", "cluster.hybrid_engine=true")
    rl_post_train(cfg)
    reference, hybrid = final_weights(ref_cfg), final_weights(cfg)
    assert all(torch.equal(reference[k], hybrid[k]) for k in reference)
    client, run = mlflow_run(cfg)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sync/buckets")] == [1, 2]
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff")) < 1e-4
    assert not client.get_metric_history(run.info.run_id, "perf/mfu/actor")  # no peak known for a CPU: no MFU


def test_bf16_stochastic_rounding_run_resumes_bitwise(
    tiny_model_dir: Path, faults, tmp_path: Path, prefect_harness
) -> None:
    """The demo's training shape (bf16 weights, stochastic-rounding AdamW, hybrid engine) through the flow: a run that
    crashes before its step-2 checkpoint resumes to the uninterrupted run's weights, bit for bit."""
    shape = ("cluster.hybrid_engine=true", "model.dtype=bfloat16", "actor.bf16_stochastic_round=true", IN_DRIVER)
    ref_cfg = tiny_cfg(tmp_path, tiny_model_dir, "bf16-sr", *shape)
    rl_post_train(ref_cfg)
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "bf16-sr-crashed", *shape)
    faults("checkpoint@2:fatal")
    with pytest.raises(RuntimeError, match="injected fatal fault"):
        rl_post_train(cfg)
    rl_post_train(cfg)  # resumes from step 1: moments and step counts (the rounding is keyed by them) restored
    reference, resumed = final_weights(ref_cfg), final_weights(cfg)
    assert all(v.dtype == torch.bfloat16 for v in reference.values())
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)
    client, run = mlflow_run(cfg)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
