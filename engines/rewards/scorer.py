"""Scores a batch with weighted reward functions in a process pool, one timed task per (sample, function).

Every call runs in worker processes (a `pebble.ProcessPool`), so a CPU-bound or hung function can be cut
off: a task that runs past `timeout_seconds` has its worker killed and replaced, and a task that raises
gets `fallback_score`; both are counted in the metrics and the step goes on. Tasks are tiny (about 0.1 ms
of pool overhead each), so 64 samples x a few functions score in milliseconds on a warm pool.

Workers start with "forkserver" (else "spawn"), never "fork": forking a process that holds torch or Ray
threads can deadlock. Workers resolve functions by name (`rlstages.engines.rewards.registry`), so a user function
`package.module:function` must be importable there (installed, or on `sys.path` when the pool starts).
As with any spawn/forkserver pool, a script that builds a scorer at import time needs the
`if __name__ == "__main__":` guard (Ray workers, pytest and console entry points are fine).

Results: `components[name]` is the unweighted score per sample (fallback where the call failed), and a
dict result's extra key `k` becomes `components["name/k"]` (NaN where missing). Metrics: `reward/failures`
(calls that raised, returned a non-score or lost their worker), `reward/timeouts` (calls cut off),
the same per function as `reward/<name>/failures|timeouts`, `reward/<name>/mean` and `reward/<name>/<k>/mean`.

Non-goals: reward models (`rlstages.engines.rewards.reward_model`), Ray (the caller wraps this class as an actor).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import numbers
import os
import pickle
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from pebble import ProcessPool

from rlstages.engines.rewards.registry import RewardFn, call_reward_fn, resolve_reward_fn
from rlstages.engines.score_result import ScoreResult

logger = logging.getLogger(__name__)

START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# If no task finishes for timeout_seconds + STALL_SECONDS, the pool is declared stuck and replaced
# (a last resort: pebble itself kills timed-out workers; the slack covers a worker restart).
STALL_SECONDS = 30.0

_RESOLVED: dict[str, RewardFn] = {}


def _resolve_cached(name: str) -> RewardFn:
    """Resolve a reward function once per worker process."""
    fn = _RESOLVED.get(name)
    if fn is None:
        fn = _RESOLVED[name] = resolve_reward_fn(name)
    return fn


def _init_worker(names: tuple[str, ...]) -> None:
    """Worker start-up: one thread for numeric libraries, and import the functions before any timed task."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    for name in names:
        try:
            _resolve_cached(name)
        except Exception:  # reported per sample when a task calls it
            continue


def _noop() -> None:
    """A task that makes the pool start its workers."""


def _normalize(name: str, out: Any) -> dict[str, float]:
    """Turn a function's float or dict result into `{"score": ..., extra...}` floats; raise if invalid."""
    if isinstance(out, Mapping):
        if "score" not in out:
            raise ValueError(f"reward function {name!r} returned a dict without a 'score' key")
        values = {}
        for key, value in out.items():
            if not isinstance(key, str) or not isinstance(value, numbers.Real):
                raise TypeError(f"reward function {name!r} returned a non-numeric entry {key!r}: {value!r}")
            values[key] = float(value)
    elif isinstance(out, numbers.Real):
        values = {"score": float(out)}
    else:
        raise TypeError(f"reward function {name!r} returned {type(out).__name__}, not a float or dict")
    if not math.isfinite(values["score"]):
        raise ValueError(f"reward function {name!r} returned a non-finite score {values['score']}")
    return values


def _call_reward(
    name: str,
    kwargs: dict[str, Any],
    prompt: str,
    response: str,
    ground_truth: str,
    data_source: str = "",
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Worker task: run one reward function on one sample and return its normalized result."""
    fn = _resolve_cached(name)
    return _normalize(name, call_reward_fn(fn, prompt, response, ground_truth, data_source, extra_info, **kwargs))


class RewardScorer:
    """Runs weighted reward functions over a batch in a process pool, with a per-sample timeout.

    `functions` holds `(name, weight, kwargs)`; a name is registered or `package.module:function`.
    """

    def __init__(
        self,
        functions: Sequence[tuple[str, float, dict]],
        timeout_seconds: float,
        fallback_score: float,
        num_processes: int = 1,
    ) -> None:
        if not functions:
            raise ValueError("RewardScorer needs at least one reward function")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        specs: list[tuple[str, float, dict[str, Any]]] = []
        for name, weight, kwargs in functions:
            if any(name == seen for seen, _, _ in specs):
                raise ValueError(f"reward function {name!r} is listed twice")
            resolve_reward_fn(name)  # fail fast here with a clear message, not once per sample
            try:
                pickle.dumps(kwargs)
            except Exception as err:
                raise ValueError(f"kwargs of reward function {name!r} cannot be pickled: {err}") from None
            specs.append((name, float(weight), dict(kwargs or {})))
        self.functions: tuple[tuple[str, float, dict[str, Any]], ...] = tuple(specs)
        self.timeout_seconds = float(timeout_seconds)
        self.fallback_score = float(fallback_score)
        self.num_processes = num_processes
        self._stall_seconds = self.timeout_seconds + STALL_SECONDS
        self._closed = False
        self._pool: ProcessPool | None = self._new_pool()

    def _new_pool(self) -> ProcessPool:
        """A started pool whose workers pre-import the functions (they boot while the caller goes on)."""
        context = multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":  # functions are imported by name: the server preloads this light module,
            context.set_forkserver_preload([__name__])  # not `__main__` (that would hold all of the caller's imports)
        pool = ProcessPool(
            max_workers=self.num_processes,
            initializer=_init_worker,
            initargs=(tuple(name for name, _, _ in self.functions),),
            context=context,
        )
        pool.schedule(_noop)
        return pool

    def _replace_pool(self) -> None:
        """Kill the current pool's workers and start a fresh pool."""
        self._stop_pool()
        self._pool = self._new_pool()

    def _stop_pool(self) -> None:
        """Stop the pool without waiting for pending tasks (workers get SIGTERM, then SIGKILL)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None

    def _schedule(self, args: tuple) -> Future:
        """Submit one task; a broken pool is replaced once before giving up on the task."""
        for attempt in range(2):
            if self._pool is None or not self._pool.active:
                self._replace_pool()
            assert self._pool is not None
            try:
                return self._pool.schedule(_call_reward, args=args, timeout=self.timeout_seconds)
            except RuntimeError:  # pebble: the pool is not running
                if attempt == 1:
                    raise
                self._replace_pool()
        raise AssertionError("unreachable")

    def _wait_all(self, futures: list[Future]) -> bool:
        """Wait until every future is done; False if the pool stalled (then the rest were cancelled)."""
        pending = set(futures)
        while pending:
            done, pending = wait(pending, self._stall_seconds, FIRST_COMPLETED)
            if not done:
                for future in pending:
                    future.cancel()
                return False
        return True

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        ground_truths: list[str],
        data_sources: list[str] | None = None,
        extra_infos: list[dict[str, Any]] | None = None,
    ) -> ScoreResult:
        """Score each (prompt, response, ground truth), with the row's data source and extra info when given;
        failed or timed-out calls get the fallback score."""
        data_sources = data_sources or [""] * len(prompts)
        extra_infos = extra_infos or [{} for _ in prompts]
        if not len(prompts) == len(responses) == len(ground_truths) == len(data_sources) == len(extra_infos):
            raise ValueError(
                f"prompts, responses, ground_truths, data_sources and extra_infos differ in length: "
                f"{len(prompts)}, {len(responses)}, {len(ground_truths)}, {len(data_sources)}, {len(extra_infos)}"
            )
        if self._closed:
            raise RuntimeError("RewardScorer.score called after close()")
        n = len(prompts)
        futures: dict[str, list[Future]] = {name: [] for name, _, _ in self.functions}
        for i in range(n):
            for name, _, kwargs in self.functions:
                args = (name, kwargs, prompts[i], responses[i], ground_truths[i], data_sources[i], extra_infos[i])
                futures[name].append(self._schedule(args))
        if not self._wait_all([f for column in futures.values() for f in column]):
            logger.warning("reward pool made no progress for %.1f s; replacing it", self._stall_seconds)
            self._replace_pool()
        return self._collect(futures, n)

    def _collect(self, futures: dict[str, list[Future]], n: int) -> ScoreResult:
        """Turn finished futures into scores, components and metrics."""
        scores = [0.0] * n
        components: dict[str, list[float]] = {}
        metrics = {"reward/failures": 0.0, "reward/timeouts": 0.0}
        for name, weight, _ in self.functions:
            column = [self.fallback_score] * n
            extras: dict[str, list[float]] = {}
            failures, timeouts, first_error = 0, 0, ""
            for i, future in enumerate(futures[name]):
                try:
                    values = future.result(timeout=0)
                except Exception as err:  # pebble's TimeoutError, a cancelled (stalled) task, or an error
                    if isinstance(err, TimeoutError) or future.cancelled():
                        timeouts += 1
                    else:
                        failures += 1
                        first_error = first_error or f"{type(err).__name__}: {err}".splitlines()[0]
                    continue
                column[i] = values["score"]
                for key, value in values.items():
                    if key != "score":
                        extras.setdefault(f"{name}/{key}", [math.nan] * n)[i] = value
            if failures or timeouts:
                logger.warning(
                    "reward %r: %d of %d samples failed, %d timed out (fallback %s)%s",
                    name, failures, n, timeouts, self.fallback_score,
                    f"; first error: {first_error}" if first_error else "",
                )  # fmt: skip
            for i, value in enumerate(column):
                scores[i] += weight * value
            components[name] = column
            components.update(extras)
            metrics["reward/failures"] += failures
            metrics["reward/timeouts"] += timeouts
            metrics[f"reward/{name}/failures"] = float(failures)
            metrics[f"reward/{name}/timeouts"] = float(timeouts)
            if n:
                metrics[f"reward/{name}/mean"] = sum(column) / n
            for key, values in extras.items():
                present = [v for v in values if not math.isnan(v)]
                if present:
                    metrics[f"reward/{key}/mean"] = sum(present) / len(present)
        return ScoreResult(scores=scores, components=components, metrics=metrics)

    def close(self) -> None:
        """Shut the pool down (pending tasks are dropped); the scorer cannot be used afterwards."""
        self._stop_pool()
        self._closed = True
