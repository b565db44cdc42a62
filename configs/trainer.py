"""The trainer section: the loop (steps, evaluation cadence, seed, profiling), its mode (sync, one-step-off,
async) and the async options (their checks that need the rest of the run: `run.check_async`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from rlstages.configs.base import StrictModel
from rlstages.configs.evaluation import EvalWindow

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


ProfiledStage = Literal[
    "generate",
    "score_rewards",
    "actor_logprobs",
    "ref_logprobs",
    "critic_values",
    "update_critic",
    "update_actor",
    "sync_weights",
]


class ProfileConfig(StrictModel):
    """torch.profiler around named stages of some steps, in each worker of the stage's roles (docs/observability.md):
    Chrome traces, a top-ops table, peak RSS (CPU) or CUDA memory snapshots, logged to MLflow under
    profiles/step_N/<stage>/<worker>. Off (no steps) by default."""

    steps: tuple[int, ...] = Field(default=(), description="Steps to profile (1-based); empty = off.")
    stages: tuple[ProfiledStage, ...] = Field(
        default=("update_actor", "generate"), min_length=1, description="Stages profiled in those steps."
    )
    record_shapes: bool = False
    with_stack: bool = False
    memory: bool = Field(
        default=True,
        description="Profiler memory events, each worker's peak RSS during the stage, and on CUDA a memory "
        "snapshot (torch.cuda.memory._record_memory_history) for pytorch.org/memory_viz.",
    )

    @field_validator("steps")
    @classmethod
    def _positive(cls, steps: tuple[int, ...]) -> tuple[int, ...]:
        if any(s < 1 for s in steps):
            raise ValueError(f"steps {list(steps)}: expected step numbers >= 1")
        return steps


TrainerMode = Literal["sync", "one_step_off", "async"]
CpuClass = Literal["native-bf16", "avx512", "avx2"]  # engines.training.machine.Machine.cpu_class


def _check_costs(field: str, shape: list[float]) -> None:
    bad = [c for c in shape if not c > 0]
    if bad:
        raise ValueError(f"{field}: {bad[0]} is not a positive relative cost (expected e.g. 1.5)")


class AsyncConfig(StrictModel):
    """Fully asynchronous training (`trainer.mode: async`, docs/async.md): generation streams finished prompt
    groups into a bounded queue while the trainer updates; a group starts only while every sample it adds would
    be trained within `max_staleness` policy versions of the one that generates it."""

    max_staleness: int = Field(
        default=1,
        ge=0,
        description="eta: the most policy versions a trained token may lag the trainer (trainer version at the "
        "update - the token's version, queue time included). 0 = synchronous; 1 without partial rollouts = "
        "one-step-off. Admission control keeps it, no sample is ever dropped for age.",
    )
    partial_rollout: bool = Field(
        default=False,
        description="Continue sequences in flight across a weight update (tokens then carry mixed versions; "
        "rollout.backend hf or vllm; sglang written, not run); false: a weight update waits for the groups in flight "
        "to finish.",
    )
    kv_on_update: Literal["recompute", "keep"] = Field(
        default="recompute",
        description="With partial_rollout, the in-flight sequences' KV cache after a weight update: recompute "
        "(prefill under the new weights, exact) or keep (old weights' KV, recorded as such; rollout.backend hf only).",
    )
    queue_capacity: int | None = Field(
        default=None,
        ge=1,
        description="Finished prompt groups the queue holds; None = (max_staleness + 1) x data.prompts_per_step, "
        "the most admission control can let in.",
    )
    replay: Path | None = Field(
        default=None,
        description="A recorded run's schedule.jsonl to follow instead of the real clock (set by `rlstages "
        "replay`, docs/async.md): the same samples enter the same updates with the same versions.",
    )


class TrainerConfig(StrictModel):
    """The loop: how many steps, how often to evaluate, the seed everything derives from."""

    model_config = ConfigDict(**StrictModel.model_config, populate_by_name=True)

    total_steps: int = Field(ge=1)
    eval_every: int = Field(default=0, ge=0, description="0 = only at start and end.")
    eval_windows: list[EvalWindow] = Field(
        default_factory=list,
        description="Steps evaluated at their own cadence (a window's `every` replaces eval_every inside "
        "first..last): the demo evaluates every 2 steps where held-out crosses 0.8 and every 6 elsewhere.",
    )
    eval_at_start: bool = True
    step_cost_shape: list[float] = Field(
        default_factory=list,
        description="Each step's expected cost relative to the others (steps past its end cost as its last): the "
        "ETA's shape of the steps ahead until a run of this config has finished in its experiment, whose measured "
        "step times then take its place. A step's cost follows its replies' length, which one step cannot foresee "
        "(the demo's halves over its first steps). Empty: the ETA scales the steps measured so far.",
    )
    step_cost_shape_by_class: dict[CpuClass, list[float]] = Field(
        default_factory=dict,
        description="`step_cost_shape` for one class of CPU (native-bf16, avx512, avx2: the class the start-up "
        "line names), in place of the general one: how much a step's cost falls as the replies shorten depends "
        "on how the CPU splits it between generation and update.",
    )
    seed: int = 0
    on_nonfinite: Literal["stop", "skip"] = Field(
        default="stop",
        description="A step whose loss or grad norm is NaN/inf: stop fails the run (MLflow FAILED, stage tagged) "
        "before the weights are synced or checkpointed; skip logs `train/rejected_steps` and goes on (the "
        "trainers do not apply a non-finite gradient).",
    )
    output_dir: Path = Path("runs")
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    run_name: str | None = Field(
        default=None,
        description="Directory name under output_dir (letters, digits, '_' and '-'; at most 100); "
        "None = run-<config hash>.",
    )
    mode: TrainerMode = Field(
        default="sync",
        description="sync: generate, then train, each step; one_step_off: generate step k+1 while the trainer "
        "updates on step k (rollout weights one update old); async: generation streams into a bounded queue, "
        "staleness bounded by trainer.async.max_staleness. one_step_off and async need cluster.hybrid_engine: "
        "false; the rollout engines then stay awake during the update (colocated ones do not sleep). Pair with "
        "algorithm.rollout_is or algorithm.decoupled_loss to correct the lag. A resumed run regenerates its first "
        "step's rollouts with the checkpoint's weights.",
    )
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    checkpoint_on_signal: bool = Field(
        default=False,
        description="On Ctrl-C or SIGTERM (a scheduler, `kubectl delete`, a spot reclaim): finish the step in "
        "progress, commit a checkpoint at its boundary, then stop (a second signal stops at once). false: stop at "
        "once; a re-run resumes from the last checkpoint (checkpoint.every). docs/production.md.",
    )
    one_step_off_policy: bool = Field(
        default=False,
        description="The older spelling of mode: one_step_off (still accepted; kept equal to it).",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_flag(cls, data: object) -> object:
        """Map the old `one_step_off_policy` flag onto `mode` (and keep the flag equal to mode == one_step_off)."""
        if not isinstance(data, dict):
            return data
        if not data.get("one_step_off_policy"):
            return {**data, "one_step_off_policy": data.get("mode") == "one_step_off"}
        if data.get("mode", "one_step_off") != "one_step_off":
            raise ValueError(
                f"trainer.one_step_off_policy: true contradicts trainer.mode: {data['mode']}; drop the old flag "
                "(trainer.mode says it)"
            )
        return {**data, "mode": "one_step_off"}

    @field_validator("step_cost_shape")
    @classmethod
    def _positive_costs(cls, shape: list[float]) -> list[float]:
        """A relative cost must be a positive number (the ETA divides by it)."""
        _check_costs("trainer.step_cost_shape", shape)
        return shape

    @field_validator("step_cost_shape_by_class")
    @classmethod
    def _positive_class_costs(cls, shapes: dict[CpuClass, list[float]]) -> dict[CpuClass, list[float]]:
        """Each class's relative costs must be positive numbers too."""
        for name, shape in shapes.items():
            _check_costs(f"trainer.step_cost_shape_by_class.{name}", shape)
        return shapes

    def cost_shape(self, cpu_class: str) -> list[float]:
        """The ETA's step cost shape on a CPU of `cpu_class`: its own where configured, else the general one."""
        return self.step_cost_shape_by_class.get(cpu_class, self.step_cost_shape)  # type: ignore[call-overload]

    @property
    def overlaps_generation(self) -> bool:
        """Whether generation runs beside the update (one_step_off or async): rollout weights lag the trainer."""
        return self.mode != "sync"

    @field_validator("run_name")
    @classmethod
    def _safe_name(cls, name: str | None) -> str | None:
        if name is not None and not RUN_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a run name: use 1-100 letters, digits, '_' and '-', starting with a letter or "
                "digit (no '/', '.', spaces; omit the field for run-<config hash>)"
            )
        return name
