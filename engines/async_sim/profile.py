"""What the simulator of asynchronous training knows about the engines: reply lengths, the cost of one decode step
of a rollout worker as a function of how many rows it decodes at once, prefill, the trainer's time per step and the
weight sync's time. Fitted from a recorded run (engines/async_sim/fit.py) or from a GPU profile (`gpu_profile`).

Decode model: a worker decoding k rows at once takes `decode_s + decode_row_s * k` seconds per token step (a
memory-bound part that does not depend on k, and a part that does); a row's prompt costs `prefill_s` once.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LengthModel:
    """Reply lengths in tokens: a log-normal of mean `mean` and shape `sigma`, cut at `cap` (max_new_tokens), at
    least 1; `sigma` 0 gives every reply the mean."""

    mean: float
    cap: int
    sigma: float = 0.8

    def sample(self, rng: random.Random) -> int:
        """One reply's length."""
        if self.sigma <= 0:
            return max(1, min(self.cap, round(self.mean)))
        mu = math.log(max(self.mean, 1.0)) - self.sigma**2 / 2
        return max(1, min(self.cap, round(rng.lognormvariate(mu, self.sigma))))


@dataclass(frozen=True)
class EngineProfile:
    """Latencies of one rollout worker and of the trainer (seconds), and the reply lengths."""

    lengths: LengthModel
    decode_s: float  # per token step, whatever the number of rows
    decode_row_s: float  # per token step and row decoded
    prefill_s: float  # per row, once, when it starts (and again at a sync with partial rollouts: KV recomputed)
    train_step_s: float  # trainer time per step (rewards, log-probs, advantages, update) ...
    train_token_s: float  # ... plus this per trained token
    sync_s: float  # one weight sync (trainer and rollout workers both busy)

    def decode_step_s(self, rows: int) -> float:
        """One token step of a worker decoding `rows` rows at once."""
        return self.decode_s + self.decode_row_s * rows

    def train_s(self, tokens: int) -> float:
        """The trainer's time for one step of `tokens` reply tokens (sync excluded)."""
        return self.train_step_s + self.train_token_s * tokens

    def scaled(self, rollout: float = 1.0, trainer: float = 1.0) -> EngineProfile:
        """The profile with every rollout latency times `rollout` and the trainer's times `trainer` (a worker on
        more or fewer GPUs, a trainer on more or fewer GPUs: linear scaling assumed)."""
        return replace(
            self,
            decode_s=self.decode_s * rollout,
            decode_row_s=self.decode_row_s * rollout,
            prefill_s=self.prefill_s * rollout,
            train_step_s=self.train_step_s * trainer,
            train_token_s=self.train_token_s * trainer,
        )


def batch_decode_s(profile: EngineProfile, lengths: list[int]) -> float:
    """Time for one worker to generate rows of these lengths all started at once (static batch): prefill, then
    one token step per token of the longest, each step costing by the rows still decoding."""
    if not lengths:
        return 0.0
    total, done, prev = profile.prefill_s * len(lengths), 0, 0
    for length in sorted(lengths):
        total += (length - prev) * profile.decode_step_s(len(lengths) - done)
        prev, done = length, done + 1
    return total


def gpu_profile(
    generate_s: float,
    step_s: float,
    rows_per_worker: int,
    lengths: LengthModel,
    sync_s: float,
    memory_bound_share: float = 0.5,
    seed: int = 0,
    workers: int = 1,
) -> EngineProfile:
    """A profile from a synchronous step's figures (e.g. verl's table: generation 60 s of a 120 s step): the trainer
    gets the rest of the step less the sync; decode costs as `matched_profile`."""
    if not 0 < generate_s < step_s or sync_s < 0 or generate_s + sync_s >= step_s:
        raise ValueError(f"generate_s={generate_s}, sync_s={sync_s} must be > 0 and together below step_s={step_s}")
    train_s = step_s - generate_s - sync_s
    return matched_profile(generate_s, rows_per_worker, lengths, train_s, sync_s, memory_bound_share, seed, workers)


def matched_profile(
    generate_s: float,
    rows_per_worker: int,
    lengths: LengthModel,
    train_s: float,
    sync_s: float,
    memory_bound_share: float = 0.5,
    seed: int = 0,
    workers: int = 1,
) -> EngineProfile:
    """Decode costs scaled so that a step -- `workers` workers each with a batch of `rows_per_worker` rows (all at
    once, lengths drawn from `lengths`), the slowest one setting the time -- takes `generate_s` on average; at that
    full batch `memory_bound_share` of a token step does not depend on the rows. Prefill is folded into the decode
    cost (0): per-step figures cannot tell them apart."""
    if generate_s <= 0 or rows_per_worker < 1:
        raise ValueError(f"generate_s={generate_s} must be > 0 and rows_per_worker={rows_per_worker} >= 1")
    share = min(max(memory_bound_share, 0.0), 1.0)
    unit = EngineProfile(lengths, share, (1 - share) / rows_per_worker, 0.0, train_s, 0.0, sync_s)
    rng = random.Random(seed)
    trials = [
        max(batch_decode_s(unit, [lengths.sample(rng) for _ in range(rows_per_worker)]) for _ in range(workers))
        for _ in range(16)
    ]
    scale = generate_s / (sum(trials) / len(trials))
    return replace(unit, decode_s=unit.decode_s * scale, decode_row_s=unit.decode_row_s * scale)
