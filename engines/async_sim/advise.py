"""The rollout:trainer split and eta the simulator suggests for a GPU budget, from a synchronous colocated reference
step (verl's table for the seed presets, or figures given), and its predicted speed-up over that synchronous run.

Assumptions (docs/async.md, "Simulator"): a rollout worker keeps its GPUs, latencies and the number of rows it
decodes at once (the reference's batch per worker: its KV room); generation on fewer workers gives each more rows;
the trainer's time scales with 1 / its GPUs (linear, whatever its parallel layout: whether the model fits on the
trainer's share is the memory plan's question); a weight sync between disjoint GPUs moves bf16 weights at
`SYNC_GBPS`; reply lengths are log-normal around the reference's mean, cut at max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlstages.engines.async_sim.profile import LengthModel, gpu_profile
from rlstages.engines.async_sim.sim import SimConfig, simulate

SYNC_GBPS = 25.0  # GB/s, trainer -> rollout broadcast of the weights (NVLink / InfiniBand, assumed)
ETAS = (0, 1, 2, 3)
STEPS = 10

# verl's Megatron table (../shared/seeds, "训练吞吐量对比"): GPUs, mean reply length, generation s, step s
VERL_TABLE: dict[str, tuple[int, int, float, float]] = {
    "Qwen2-7B-Instruct": (8, 512, 60.0, 120.0),
    "Qwen3-235B-A22B": (32, 1024, 420.0, 600.0),
    "DeepSeek-V3": (96, 1960, 1050.0, 1700.0),
}


@dataclass(frozen=True)
class Reference:
    """A synchronous colocated step: GPUs, rollout workers, batch, reply lengths, generation and step seconds."""

    gpus: int
    rollout_workers: int
    groups_per_step: int
    samples_per_group: int
    lengths: LengthModel
    generate_s: float
    step_s: float
    sync_s: float

    @property
    def gpus_per_worker(self) -> int:
        """GPUs of one rollout worker (its tensor-parallel group)."""
        return max(1, self.gpus // self.rollout_workers)


@dataclass(frozen=True)
class Suggestion:
    """One simulated layout: the split, eta, whether partial rollouts, and what the simulator predicts."""

    rollout_gpus: int
    trainer_gpus: int
    eta: int
    partial_rollout: bool
    samples_per_s: float
    sync_samples_per_s: float
    lag_mean: float
    lag_max: float
    rollout_idle: float
    trainer_idle: float

    @property
    def speedup(self) -> float:
        """Predicted samples/s over the synchronous colocated reference's."""
        return self.samples_per_s / self.sync_samples_per_s


def sync_seconds(params: int) -> float:
    """A weight sync of `params` bf16 parameters between disjoint GPUs at SYNC_GBPS (assumed)."""
    return 2.0 * params / (SYNC_GBPS * 1e9)


def candidates(ref: Reference, etas: tuple[int, ...] = ETAS, steps: int = STEPS, seed: int = 0) -> list[Suggestion]:
    """Every split (whole rollout workers, at least one GPU left to the trainer) x eta x partial rollouts on/off,
    simulated; and the synchronous reference (the same lengths, all GPUs for each phase) for the speed-up."""
    rows = ref.groups_per_step * ref.samples_per_group
    per_worker = -(-rows // ref.rollout_workers)
    base = gpu_profile(ref.generate_s, ref.step_s + ref.sync_s, per_worker, ref.lengths, ref.sync_s, seed=seed,
                       workers=ref.rollout_workers)  # fmt: skip
    sync_cfg = SimConfig(ref.groups_per_step, ref.samples_per_group, 0, steps, ref.rollout_workers, seed=seed)
    colocated = replace(base, sync_s=0.0)  # its own sync (resharding in place) is inside its measured step
    sync_rate = simulate(colocated, sync_cfg).steady_samples_per_s(rows, skip=2)
    found = []
    for workers in range(1, ref.rollout_workers):
        rollout_gpus = workers * ref.gpus_per_worker
        trainer_gpus = ref.gpus - rollout_gpus
        profile = base.scaled(trainer=ref.gpus / trainer_gpus)
        for eta in etas:
            for partial in (False, True):
                cfg = SimConfig(ref.groups_per_step, ref.samples_per_group, eta, steps, workers, partial, partial,
                                slots=per_worker, seed=seed)  # fmt: skip
                r = simulate(profile, cfg)
                found.append(Suggestion(rollout_gpus, trainer_gpus, eta, partial, r.steady_samples_per_s(rows, 2),
                                        sync_rate, r.lag_mean, r.lag_max, r.rollout_idle_fraction,
                                        r.trainer_idle_fraction))  # fmt: skip
    return found


def suggest(found: list[Suggestion], within: float = 0.03) -> Suggestion:
    """The fastest layout, or the one with the smallest eta (then without partial rollouts) within `within` of it:
    less staleness for almost the same speed."""
    if not found:
        raise ValueError("no split to simulate: the reference has a single rollout worker")
    best = max(s.samples_per_s for s in found)
    near = [s for s in found if s.samples_per_s >= (1 - within) * best]
    return min(near, key=lambda s: (s.eta, s.partial_rollout, -s.samples_per_s))
