"""The RL post-training flow. Read this first: one iteration is the DAG of design §2.

    sample prompts -> generate -+-> score_rewards ----+
                                +-> actor_logprobs ---+-> advantages -> update_critic -> update_actor -> sync_weights
                                +-> ref_logprobs -----+        every m steps: evaluate, every k steps: checkpoint
                                +-> critic_values ----+

Each stage is a Prefect task with its own retries and timeout, dispatching to Ray actors; tasks pass the
run handle and step, never actor handles or tensors. A dead worker makes the flow reload the last committed
checkpoint and replay from there. No backend appears here: the registries chose them.

With `trainer.mode: one_step_off`, `generate` of step k+1 runs beside the rest of step k (same DAG; the
rollout's weights are one update old) and step k+1 starts from those rollouts; `algorithm.rollout_is` corrects.
With `trainer.mode: async`, generation runs ahead as far as `trainer.async.max_staleness` allows and each step
takes its rollouts from a queue (flows/async_train.py); the rest of the DAG is the same.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass

from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from rlstages.configs import RunConfig
from rlstages.configs.evaluation import eval_due
from rlstages.flows.async_partial import start_feed
from rlstages.flows.async_train import AsyncFeed
from rlstages.flows.commits import CheckpointCommits
from rlstages.flows.console import machine_of
from rlstages.flows.flow_guard import guarded_flow
from rlstages.flows.interrupts import stop_on_signal
from rlstages.flows.progress import Plan, RunProgress, configured_shape, eval_share, flow_run_name, run_progress
from rlstages.flows.stages import POOL_THREADS, Metrics, Stages
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.tracking import earlier_step_seconds, log_run_metrics, log_step, set_tags
from rlstages.tasks.policies import WorkerLost, failed_stage
from rlstages.tasks.run import close_run, convert_for_training, driver_snapshot, link_mlflow_run


@dataclass(frozen=True)
class StepResult:
    """One iteration's metrics (every stage's, merged) and the KL controller's state after it."""

    metrics: Metrics
    kl_state: dict[str, float]
    ahead: Metrics | None = None  # metrics of step+1's generation when it ran during this step (off-policy)


def rl_step(
    s: Stages,
    cfg: RunConfig,
    run: RunHandle,
    step: int,
    kl_state: dict[str, float],
    ui: RunProgress,
    ahead: Metrics | None = None,
    feed: AsyncFeed | None = None,
) -> StepResult:
    """One iteration of the DAG above. `ahead`: this step's rollouts were generated during the last step;
    `feed`: they come from the async queue."""
    if feed is not None:
        ui.stage("wait for rollouts")
        metrics = feed.batch(step)  # generated ahead, within max_staleness versions
    elif ahead is None:
        ui.stage("generate")
        metrics = s.generate(cfg, run, step)  # colocated rollout engines sleep until the next sync
    else:  # its time overlapped the last step's: kept out of this step's timing/ sum
        metrics = {("rollout/generate_ahead_s" if k == "timing/generate_s" else k): v for k, v in ahead.items()}
    off_policy = cfg.trainer.one_step_off_policy and step < cfg.trainer.total_steps
    next_rollout = s.generate.submit(cfg, run, step + 1) if off_policy else None
    ui.stage("rewards / log-probs")
    readers = [s.score_rewards]
    if cfg.needs_old_logprobs or cfg.algorithm.use_kl_in_reward:
        readers.append(s.actor_logprobs)
    if cfg.uses_reference:
        readers.append(s.ref_logprobs)
    if cfg.critic is not None:
        readers.append(s.critic_values)
    for result in s.together(readers, cfg, run, step):  # at most prefect.max_concurrent_stages at once
        metrics.update(result)
    ui.stage("advantages")
    adv = s.advantages(cfg, run, step, kl_state)
    metrics.update(adv.metrics)
    if cfg.critic is not None:
        ui.stage("update critic")
        metrics.update(s.update_critic(cfg, run, step))
    if step > cfg.algorithm.critic_warmup_steps:
        ui.stage("update actor")
        metrics.update(s.update_actor(cfg, run, step))
    ui.stage("sync weights")
    next_metrics = next_rollout.result() if next_rollout is not None else None  # sync only after it finished
    if feed is not None:
        metrics.update(feed.before_sync(step))  # likewise: no generation sees its weights change
    metrics.update(feed.sync(step) if feed is not None else s.sync_weights(cfg, run, step))  # async: elastic
    timing = sum(v for k, v in metrics.items() if k.startswith("timing/"))
    metrics["timing/step_s"] = timing
    if feed is not None:
        metrics.update(feed.synced(step, timing))  # the next steps' generations may start
    metrics["throughput/tokens_per_s"] = metrics.get("rollout/tokens", 0.0) / max(timing, 1e-9)
    return StepResult(metrics, adv.kl_state, next_metrics)


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


@guarded_flow(
    name="rl-post-train",
    flow_run_name=flow_run_name,
    task_runner=ThreadPoolTaskRunner(max_workers=POOL_THREADS),  # type: ignore[arg-type]  # prefect stub: infers Never
    validate_parameters=True,
)
def rl_post_train(cfg: RunConfig) -> str:
    """Train a policy with RL as configured; resumes its run directory's last checkpoint. Returns the policy dir."""
    began = time.monotonic()  # the run's time, against which its evaluations' share is logged (`time/`)
    s = Stages.configured(cfg)
    run = s.prepare_run(cfg)
    mlflow_run_id = s.start_tracking(cfg, run)
    link_mlflow_run(cfg, run, mlflow_run_id)  # the flow run's Artifacts tab links to the MLflow run
    set_tags(cfg, mlflow_run_id, machine_of(cfg).tags())  # which machine (CPU, bf16, GEMM kernel) ran it
    total = cfg.trainer.total_steps
    feed: AsyncFeed | None = None
    commits = CheckpointCommits(s, cfg, run)  # a checkpoint's commit runs beside the next step
    step, stop = 0, stop_on_signal(cfg)  # Ctrl-C / SIGTERM: stop at a safe point, say what was kept
    try:
        convert_for_training(cfg, run)  # HF -> Megatron-Core, cached; a no-op for other backends
        start = s.start_workers(cfg, run)
        evaluated_s: tuple[float, ...] = ()
        if start.step == 0 and cfg.trainer.eval_at_start:
            at = time.monotonic()
            s.evaluate(cfg, run, 0, mlflow_run_id)
            evaluated_s = (time.monotonic() - at,)  # its logging and plot included, as the ETA counts them
            log_run_metrics(cfg, mlflow_run_id, 0, {"time/eval_s": evaluated_s[0]})
        step, kl_state, recoveries, ahead = start.step + 1, start.kl_state, 0, None
        plan = Plan(
            lambda k: eval_due(k, cfg.trainer.eval_every, cfg.trainer.eval_windows, total),
            lambda k: _due(k, cfg.checkpoint.every, total),
            evaluated_s,
            # the ETA's shape of the steps ahead: an earlier run's where one has seen it, else the configured one
            earlier_step_seconds(cfg, mlflow_run_id)
            or configured_shape(cfg.trainer.cost_shape(machine_of(cfg).cpu_class), total),
        )
        feed = start_feed(s, cfg, run, start.step)  # async: generation runs ahead from here on
        with run_progress(run.name, total, start.step, plan) as ui:
            while step <= total:
                try:  # a worker lost in any stage of the step, its evaluation or its checkpoint: replay
                    result = rl_step(s, cfg, run, step, kl_state, ui, ahead, feed)
                    log_step(cfg, mlflow_run_id, step, result.metrics)  # a replayed step is not logged twice
                    ui.step_done(step, result.metrics)
                    commits.poll()  # a checkpoint's commit that ended beside this step is said now
                    if eval_due(step, cfg.trainer.eval_every, cfg.trainer.eval_windows, total):
                        ui.stage("evaluate")
                        with feed.engines_free() if feed else nullcontext():
                            ui.evaluated(step, s.evaluate(cfg, run, step, mlflow_run_id))
                        log_run_metrics(cfg, mlflow_run_id, step, {"time/eval_s": ui.evaluation_seconds()[-1]})
                    if _due(step, cfg.checkpoint.every, total) or stop.checkpoint_now():
                        ui.stage("checkpoint")
                        commits.save(step, driver_snapshot(cfg, step, result.kl_state, mlflow_run_id), ui)
                except WorkerLost as lost:
                    ahead = None  # the replay generates its first step again
                    recoveries += 1
                    if recoveries > cfg.prefect.max_worker_recoveries:
                        raise
                    ui.recovering(step, lost, recoveries, cfg.prefect.max_worker_recoveries)
                    if feed is not None:
                        feed.close()
                    commits.settle()  # a commit in flight may yet be the checkpoint to replay from
                    start = s.recover_workers(cfg, run)  # replay from the last committed checkpoint
                    step, kl_state = start.step + 1, start.kl_state
                    feed = start_feed(s, cfg, run, start.step)  # in flight or queued: generated again
                    continue
                kl_state, ahead = result.kl_state, result.ahead
                stop.at_boundary()  # with trainer.checkpoint_on_signal: after the step's checkpoint
                step += 1
            commits.wait()  # the last checkpoint committed before the export
        if feed is not None:
            feed.close()
        policy = s.export_policy(cfg, run, mlflow_run_id)
        log_run_metrics(cfg, mlflow_run_id, total, eval_share(ui.evaluation_seconds(), time.monotonic() - began))
    except BaseException as exc:
        stage = failed_stage(flow_run.id)  # read first: a commit failing while it settles must not relabel the run
        commits.settle()
        if feed is not None:
            feed.close(wait=False)
        if (stopped := stop.stopped(exc, cfg, run, step)) is not None:
            close_run(cfg, run, mlflow_run_id, "KILLED", stopped.line(), stage)
            return stopped.state()  # type: ignore[return-value]  # the flow run is Cancelled; the caller gets RunStopped
        close_run(
            cfg,
            run,
            mlflow_run_id,
            "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED",
            f"{type(exc).__name__}: {exc}",
            stage,
        )
        raise
    finally:
        stop.restore()
    close_run(cfg, run, mlflow_run_id, "FINISHED")
    return policy
