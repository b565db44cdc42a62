"""The driver's side of partial rollouts (`trainer.async.partial_rollout: true`): the rollout engines' streams
(`engines/rollout/streaming.py`) started, fed prompt groups, pumped, told of each weight update; finished groups
assembled into a step's rollout batch.

The per-token policy versions have one source: the engine stamps each token with its `policy_version` (set here at
start from the checkpoint's step and after every sync), the batch carries them (`T.ROLLOUT_VERSIONS`), and the
versions file beside the batch and the queue's lag accounting are read from that field.

A rank whose worker dies (`dead`: what its calls then raise, where the feed restarts ranks -- Ray, rollout workers
of their own) is set aside (`lost`): the other ranks go on, the groups it had in flight stay on its books, and
`restarted` (the feed, once a fresh worker with the trainer's weights is in its place) starts its stream and submits
those groups again, from their prompts: the tokens they had died with the worker, so they are generated again, under
the version the fresh worker has.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from rlstages.configs import RunConfig
from rlstages.engines import types as T
from rlstages.engines.rollout.async_queue import ROLLOUT_VERSIONS, QueueItem
from rlstages.engines.rollout.batching import build_rollout_batch
from rlstages.engines.rollout.streaming import FinishedGroup, GroupRequest
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.tasks.driver.context import RunHandle, derive_seed
from rlstages.tasks.driver.data.loading import prompts_for_step, tokenizer_path
from rlstages.tasks.driver.role_handles import RolloutGroup


class Streams:
    """The rollout ranks' streams of one run (or recovery): groups spread over the ranks by number."""

    def __init__(
        self,
        cfg: RunConfig,
        run: RunHandle,
        rollout: RolloutGroup,
        params: SamplingParams,
        start_step: int,
        dead: tuple[type[BaseException], ...] = (),
    ) -> None:
        """Start a fresh stream on every rank (`rollout`: the generate stage's handle), sampling with `params`,
        at policy version `start_step` (the checkpoint's); `dead`: what a rank's call raises when its worker died
        (the feed's `WorkerLost` where it restarts ranks): that rank is set aside, not raised."""
        self.cfg, self.run, self.rollout, self.params = cfg, run, rollout, params
        self.ranks, self.dead = self.rollout.ranks, dead
        self._prompts: dict[int, list[Prompt]] = {}
        self.on: dict[int, int] = {}  # group -> the rank decoding it (submitted, not finished)
        self.lost: set[int] = set()  # ranks whose worker died, until `restarted`
        self.waiting: list[int] = []  # groups admitted while every rank was lost
        for rank in range(self.ranks):
            self.rollout.set_policy_version(rank, start_step)
            seed = derive_seed(cfg.trainer.seed, start_step + 1, f"stream-{rank}")
            self.rollout.start_stream(rank, params, seed)

    def prompts(self, step: int) -> list[Prompt]:
        """Step `step`'s prompts (the same as the `generate` task's)."""
        if step not in self._prompts:
            cfg = self.cfg
            self._prompts[step] = prompts_for_step(cfg.data, step, cfg.trainer.seed, tokenizer_path(cfg))
        return self._prompts[step]

    def _live(self) -> list[int]:
        return [r for r in range(self.ranks) if r not in self.lost]

    def submit(self, groups: list[int]) -> None:
        """Submit these group numbers (group g = prompt g mod B of step g // B + 1) to rank g mod ranks, or, that
        rank lost, to a live one (none live: they wait for a restart)."""
        b, n = self.cfg.data.prompts_per_step, self.cfg.rollout.n
        live = self._live()
        if not live:
            self.waiting += groups
            return
        by_rank: dict[int, list[GroupRequest]] = {}
        for g in groups:
            prompt = self.prompts(g // b + 1)[g % b]
            rank = g % self.ranks if g % self.ranks in live else live[g % len(live)]
            by_rank.setdefault(rank, []).append(GroupRequest(g, prompt, n))
            self.on[g] = rank
        for rank, requests in by_rank.items():
            try:
                self.rollout.submit(rank, requests)
            except self.dead:  # its groups stay on its books
                self.lost.add(rank)

    def pump(self, steps: int) -> list[FinishedGroup]:
        """Up to `steps` decode steps on every live rank; the groups finished."""
        done = []
        for rank in self._live():
            try:
                finished = self.rollout.pump(rank, steps)
            except self.dead:
                self.lost.add(rank)
                continue
            for group in finished:
                self.on.pop(group.group, None)
            done += finished
        return done

    def in_flight(self) -> list[list[int]]:
        """Every rank's rows decoding now, [group, sample, tokens so far], sorted (the schedule's interrupt points)."""
        return sorted([g, m, t] for rank in self._live() for g, m, t in self.rollout.in_flight_rows(rank))

    def updated(self, version: int) -> None:
        """The weights were just synced to policy `version`: the rows in flight continue under them."""
        kv = self.cfg.trainer.async_.kv_on_update
        for rank in self._live():
            self.rollout.set_policy_version(rank, version, kv)

    def restarted(self, rank: int, version: int) -> list[int]:
        """Lost rank `rank` has a fresh worker with policy `version`'s weights: its stream started (seeded by the
        version) and the groups the dead one had in flight, and those waiting for a live rank, submitted again
        (from their prompts); those groups."""
        self.rollout.set_policy_version(rank, version)
        self.rollout.start_stream(rank, self.params, derive_seed(self.cfg.trainer.seed, version + 1,
                                                                 f"stream-{rank}-restart"))  # fmt: skip
        self.lost.discard(rank)
        again = sorted([g for g, r in self.on.items() if r == rank] + self.waiting)
        self.waiting = []
        self.submit(again)
        return again

    def stop(self) -> None:
        """Drop the streams (best effort: a dead worker has none left)."""
        for rank in self._live():
            try:
                self.rollout.stop_stream(rank)
            except Exception:  # noqa: BLE001 - the workers are being replaced
                pass

    def assemble(self, step: int, groups: list[FinishedGroup], started: float) -> QueueItem:
        """Step `step`'s rollout batch from its finished groups (in group order): saved as the `generate` task
        saves it, its versions file written from the batch's own field; the queue item with its metrics."""
        groups = sorted(groups, key=lambda g: g.group)
        n = self.cfg.rollout.n
        batch = build_rollout_batch(
            self.prompts(step),
            [g.prompt_ids for g in groups],
            [ids for g in groups for ids in g.ids],
            [lps for g in groups for lps in g.logprobs],
            [t for g in groups for t in g.texts],
            n,
            groups[0].pad_id,
            [v for g in groups for v in g.versions],
        )
        T.save_batch(batch, self.run.batch(step, "rollout"))
        mask, versions = batch[T.RESPONSE_MASK] > 0, batch[T.ROLLOUT_VERSIONS]
        stamps = TensorDict({ROLLOUT_VERSIONS: versions}, batch_size=batch.batch_size)
        T.save_batch(stamps, self.run.batch(step, "versions"))
        counts = Counter(versions[mask].tolist())
        lengths = mask.sum(-1)
        elapsed = time.perf_counter() - started
        metrics = {
            "response_length/mean": float(lengths.float().mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float((lengths >= self.cfg.rollout.response_budget).float().mean()),
            "rollout/tokens": float(lengths.sum()),
            "async/mixed_version_sequences": float(mixed_rows(versions, mask)),
            "timing/generate_s": elapsed,
        }
        return QueueItem(
            first=groups[0].group,
            groups=len(groups),
            version_tokens={int(v): int(c) for v, c in counts.items()},
            lengths=[int(x) for x in lengths.tolist()],
            payload={"step": step, "metrics": metrics},
            interrupted=sum(g.interrupted for g in groups),
        )


def mixed_rows(versions: torch.Tensor, mask: torch.Tensor) -> int:
    """Rows whose tokens come from more than one policy version (tests, metrics)."""
    return int(sum(len(set(row[m > 0].tolist())) > 1 for row, m in zip(versions, mask, strict=True)))
