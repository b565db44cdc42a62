"""Typed handles of the run's worker groups as the stage tasks call them: one class per kind of engine, whose methods
are the engine Protocol's (`engines.base`) with the types a whole group returns, each dispatched the one way the
stages use it (a batch split over the data-parallel ranks and gathered, or the same call on every rank), under the
stage's timeout and guard. mypy checks every call a task makes into an engine against these signatures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from rlstages.engines.rollout.streaming import FinishedGroup, GroupRequest
from rlstages.engines.score_result import ScoreResult
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.actor_group import ActorGroup

Guard = Callable[[Callable[[], Any]], Any]  # runs a call into the workers (`policies.guard_workers`)


class RoleHandle:
    """A worker group, the stage's timeout and the guard its calls run under."""

    def __init__(self, group: ActorGroup, timeout: float | None, guard: Guard) -> None:
        self.group, self.timeout, self._guard = group, timeout, guard

    def _call(self, mode: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._guard(lambda: self.group.call(mode, method, args, kwargs, self.timeout))

    def _call_rank(self, rank: int, method: str, *args: Any) -> Any:
        return self._guard(lambda: self.group.call("one", method, args, {}, self.timeout, rank))


class RolloutGroup(RoleHandle):
    """The rollout engines (`base.RolloutEngine`)."""

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """The prompts split over the data-parallel ranks; their batches concatenated in prompt order."""
        return cast(TensorDict, self._call("dp", "generate", prompts, sampling, seed))

    def sleep(self) -> None:
        """Every rank frees its memory while the trainers work."""
        self._call("all", "sleep")

    def wake(self) -> None:
        """Every rank restores what `sleep` freed."""
        self._call("all", "wake")

    # partial rollouts (`engines/rollout/streaming.py`): each rank's stream is driven on its own
    @property
    def ranks(self) -> int:
        """How many rollout engines the group has."""
        return self.group.spec.num_workers

    def start_stream(self, rank: int, sampling: SamplingParams, seed: int) -> None:
        """A fresh stream on `rank` (anything in flight there dropped)."""
        self._call_rank(rank, "start_stream", sampling, seed)

    def submit(self, rank: int, groups: list[GroupRequest]) -> None:
        """Queue these prompt groups on `rank`'s stream."""
        self._call_rank(rank, "submit", groups)

    def pump(self, rank: int, max_steps: int) -> list[FinishedGroup]:
        """Up to `max_steps` decode steps on `rank`; the groups that finished."""
        return cast(list[FinishedGroup], self._call_rank(rank, "pump", max_steps))

    def in_flight_rows(self, rank: int) -> list[tuple[int, int, int]]:
        """`rank`'s rows decoding now: (group, sample, tokens so far)."""
        return cast(list[tuple[int, int, int]], self._call_rank(rank, "in_flight_rows"))

    def set_policy_version(self, rank: int, version: int, kv_on_update: str = "recompute") -> None:
        """`rank`'s weights are now policy `version`; its rows in flight continue under them."""
        self._call_rank(rank, "set_policy_version", version, kv_on_update)

    def stop_stream(self, rank: int) -> None:
        """Drop `rank`'s stream."""
        self._call_rank(rank, "stop_stream")


class TrainerGroup(RoleHandle):
    """An actor, critic or reference group (`base.TrainingEngine`): passes over a batch split by data-parallel rank,
    state calls on every rank (they are collectives on sharded backends)."""

    def logprobs(self, batch: TensorDict, temperature: float | None = None, base: bool = False) -> TensorDict:
        """Log-probs and entropy of the batch's responses, gathered from the collecting ranks."""
        return cast(TensorDict, self._call("dp", "logprobs", batch, temperature, base))

    def values(self, batch: TensorDict) -> torch.Tensor:
        """The critic's values [B, T]."""
        return cast(torch.Tensor, self._call("dp", "values", batch))

    def train_step(self, batch: TensorDict) -> list[dict[str, float]]:
        """One update on the batch; the metrics of each collecting rank."""
        out = self._call("dp", "train_step", batch)
        return cast(list[dict[str, float]], out if isinstance(out, list) else [out])

    def save_pretrained(self, path: Path, tokenizer_from: Path | None = None) -> None:
        """An HF directory of the current weights (written by the weight source, every rank joins)."""
        self._call("all", "save_pretrained", path, tokenizer_from)

    def save(self, path: Path) -> None:
        """Model, optimizer, schedule and RNG states of every rank."""
        self._call("all", "save", path)

    def load(self, path: Path) -> None:
        """Restore what `save` wrote, on every rank."""
        self._call("all", "load", path)


class RewardGroup(RoleHandle):
    """The reward-function scorer (`base.RewardFunctions`), one actor."""

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        ground_truths: list[str],
        data_sources: list[str] | None = None,
        extra_infos: list[dict[str, Any]] | None = None,
    ) -> ScoreResult:
        """Weighted scores, components and metrics of each row."""
        return cast(
            ScoreResult, self._call("one", "score", prompts, responses, ground_truths, data_sources, extra_infos)
        )


class RewardModelGroup(RoleHandle):
    """A learned reward model (`base.RewardModel`)."""

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One scalar per row, the rows split over the ranks and gathered in order."""
        return cast(list[float], self._call("dp", "score", prompts, responses))
