"""Reward functions, the registry and the process-pool scorer (real pebble pool, real Ray actor).

Run: `.venv/bin/pytest tests/engines/rewards/test_rewards.py -q` (CPU only, about 10-20 s; uses a tmp user module).
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time

import pytest
import ray

from rlstages.engines.rewards import functions as F
from rlstages.engines.rewards.registry import REWARD_FUNCTIONS, resolve_reward_fn
from rlstages.engines.rewards.scorer import RewardScorer, ScoreResult

USER_MODULE = "rlstages_test_user_rewards"
USER_SOURCE = '''
import math
import os
import time


def flaky(prompt, response, ground_truth, **extra):
    """Raises on "raise", hangs on "hang", else 1.0 if response == ground truth (and its worker pid)."""
    if "raise" in response:
        raise RuntimeError("bad sample")
    if "hang" in response:
        time.sleep(60)
    if "crash" in response:
        os._exit(3)
    return {"score": float(response == ground_truth), "pid": os.getpid()}


def with_extras(prompt, response, ground_truth, bonus=0.0, **extra):
    """A dict result: the score plus extra numeric keys."""
    return {"score": 0.5 + bonus, "length": len(response), "digits": sum(c.isdigit() for c in response)}


def bad_result(prompt, response, ground_truth, **extra):
    """Returns something that is not a score."""
    return "oops" if response == "str" else math.nan
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A user reward module in a tmp dir on sys.path (pool workers receive the parent's sys.path)."""
    root = tmp_path_factory.mktemp("user_rewards")
    (root / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_SOURCE))
    sys.path.insert(0, str(root))
    yield USER_MODULE
    sys.path.remove(str(root))
    sys.modules.pop(USER_MODULE, None)


def demo_batch(n: int) -> tuple[list[str], list[str], list[str]]:
    """The demo task "What is a + b?" with every third response wrong."""
    prompts, responses, truths = [], [], []
    for i in range(n):
        a, b = i % 20 + 1, (7 * i) % 20 + 1
        prompts.append(f"What is {a} + {b}? Reply with only the number.")
        responses.append(f"{a} + {b} = {a + b + (i % 3 == 0)}")
        truths.append(str(a + b))
    return prompts, responses, truths


# ---- built-in functions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("12", "12", 1.0),
        ("7 + 5 = 12", "12", 1.0),
        ("The answer is 3,000", "3000", 1.0),
        ("The answer is 3000.", "3,000", 1.0),
        ("It is 12, not 13", "12", 0.0),
        ("x = -5", "-5", 1.0),
        ("20-5", "-5", 0.0),
        ("\\boxed{42}", "42", 1.0),
        ("no number here", "4", 0.0),
    ],
)
def test_last_integer(response: str, truth: str, expected: float) -> None:
    assert F.last_integer("q", response, truth) == expected


def test_last_integer_rejects_non_integer_ground_truth() -> None:
    with pytest.raises(ValueError, match="not an integer"):
        F.last_integer("q", "1.5", "1.5")


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so the answer is \\boxed{42}", "42", 1.0),
        ("The answer is $42$.", "42", 1.0),
        ("The answer is 3,000", "3000", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("no answer", "42", 0.0),
    ],
)
def test_math_verify(response: str, truth: str, expected: float) -> None:
    assert F.math_verify("q", response, truth) == expected


def test_math_verify_outside_the_main_thread() -> None:
    # math-verify's own timeout uses signal.alarm, which raises in other threads unless it is switched off.
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(F.math_verify("q", "\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]


def test_exact_match() -> None:
    assert F.exact_match("q", "  Paris \n", "Paris") == 1.0
    assert F.exact_match("q", "paris", "Paris") == 0.0
    assert F.exact_match("q", "paris", "Paris", ignore_case=True) == 1.0
    assert F.exact_match("q", "Paris.", "Paris", ignore_case=True) == 0.0


def test_boxed_format() -> None:
    assert F.boxed_format("q", "so \\boxed{42}", "") == 1.0
    assert F.boxed_format("q", "\\boxed{\\frac{1}{2}}", "", require_number=True) == 1.0
    assert F.boxed_format("q", "\\boxed{3,000}", "", require_number=True) == 1.0
    assert F.boxed_format("q", "\\boxed{x+1}", "") == 1.0
    assert F.boxed_format("q", "\\boxed{x+1}", "", require_number=True) == 0.0
    assert F.boxed_format("q", "\\boxed{  }", "") == 0.0
    assert F.boxed_format("q", "\\boxed{42", "") == 0.0
    assert F.boxed_format("q", "42", "") == 0.0


# ---- registry -----------------------------------------------------------------------------------


def test_registry_resolves_every_builtin() -> None:
    for name in REWARD_FUNCTIONS:
        assert resolve_reward_fn(name) is getattr(F, name)


def test_registry_resolves_a_user_function(user_module: str) -> None:
    fn = resolve_reward_fn(f"{user_module}:with_extras")
    assert fn("q", "abc1", "x")["digits"] == 1


def test_registry_errors_are_one_line_and_say_what_failed(user_module: str) -> None:
    with pytest.raises(ValueError, match="unknown reward function 'nope'; registered: boxed_format, ") as err:
        resolve_reward_fn("nope")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'") as err:
        resolve_reward_fn("no_such_pkg.mod:fn")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=f"module '{user_module}' has no attribute 'missing'"):
        resolve_reward_fn(f"{user_module}:missing")


def test_one_importer_one_error_naming_the_field() -> None:
    """Reward functions, tool and environment classes and backends import "module:attr" through
    `engines.imports.import_object`: one error type (an ImportError and a ValueError), its line starting with
    the config field."""
    from rlstages.engines.imports import ImportTargetError, import_object
    from rlstages.engines.tools.registry import import_class

    cases = [
        (lambda: resolve_reward_fn("no_such_pkg.mod:fn", "reward.functions.0.name"), "reward.functions.0.name: "),
        (lambda: import_class("json:nope", "environment.environment"), "environment.environment: "),
        (lambda: import_object("json", "actor.backend"), "actor.backend: expected 'package.module:Name', got 'json'"),
        (lambda: resolve_reward_fn("os:sep", "reward.functions.1.name"), "reward.functions.1.name: 'os:sep' is not"),
        (lambda: import_class("json:dumps", "tools.0.name"), "tools.0.name: 'json:dumps' is not a class"),
    ]
    for call, start in cases:
        with pytest.raises(ImportTargetError) as err:
            call()
        assert str(err.value).startswith(start) and "\n" not in str(err.value)
        assert isinstance(err.value, ImportError) and isinstance(err.value, ValueError)


# ---- scorer -------------------------------------------------------------------------------------


def test_scorer_weights_components_in_one_warm_pool() -> None:
    scorer = RewardScorer(
        [("last_integer", 1.0, {}), ("boxed_format", 0.5, {}), ("exact_match", 0.25, {"ignore_case": True})],
        timeout_seconds=5.0,
        fallback_score=0.0,
    )
    try:
        prompts, responses, truths = demo_batch(64)
        responses[1] = "\\boxed{" + truths[1] + "}"
        responses[2] = truths[2]
        scorer.score(prompts[:2], responses[:2], truths[:2])  # warm the worker
        pool = scorer._pool
        result = scorer.score(prompts, responses, truths)
        assert scorer._pool is pool, "a healthy batch replaced the pool (its workers boot again per batch)"
    finally:
        scorer.close()
    assert isinstance(result, ScoreResult)
    expected_last = [F.last_integer(p, r, t) for p, r, t in zip(prompts, responses, truths, strict=True)]
    assert result.components["last_integer"] == expected_last
    assert 0.0 < sum(expected_last) < 64
    for i in range(64):
        want = expected_last[i] + 0.5 * F.boxed_format("", responses[i], "") + 0.25 * (responses[i] == truths[i])
        assert result.scores[i] == pytest.approx(want)
    assert result.scores[1] == pytest.approx(1.5) and result.scores[2] == pytest.approx(1.25)
    assert result.metrics["reward/last_integer/mean"] == pytest.approx(sum(expected_last) / 64)
    assert result.metrics["reward/failures"] == 0.0 and result.metrics["reward/timeouts"] == 0.0


def test_scorer_isolates_raising_and_hanging_samples(user_module: str) -> None:
    name = f"{user_module}:flaky"
    scorer = RewardScorer([(name, 1.0, {}), ("last_integer", 2.0, {})], timeout_seconds=1.0, fallback_score=-1.0)
    try:
        prompts = ["q"] * 5
        truths = ["7", "7", "7", "8", "9"]
        start = time.perf_counter()
        result = scorer.score(prompts, ["7", "raise 7", "hang 7", "8", "crash 9"], truths)
        elapsed = time.perf_counter() - start
        later = scorer.score(prompts, ["7", "7", "8", "8", "9"], truths)
    finally:
        scorer.close()
    assert elapsed < 15.0
    assert result.components[name] == [1.0, -1.0, -1.0, 1.0, -1.0]
    assert result.components["last_integer"] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert result.scores == [3.0, 1.0, 1.0, 3.0, 1.0]
    assert result.metrics["reward/failures"] == 2.0  # the raise and the worker that died
    assert result.metrics["reward/timeouts"] == 1.0
    assert result.metrics[f"reward/{name}/timeouts"] == 1.0
    # the later call still scores every sample, on a new worker: the hung one was killed
    assert later.components[name] == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert later.metrics["reward/failures"] == 0.0 and later.metrics["reward/timeouts"] == 0.0
    hung_pid = int(result.components[f"{name}/pid"][0])
    assert int(later.components[f"{name}/pid"][0]) != hung_pid
    with pytest.raises(ProcessLookupError):
        os.kill(hung_pid, 0)


def test_scorer_replaces_a_stalled_pool(user_module: str) -> None:
    # last resort when pebble's own timeout does not fire: no progress for a while -> new pool
    name = f"{user_module}:flaky"
    scorer = RewardScorer([(name, 1.0, {})], timeout_seconds=60.0, fallback_score=-1.0)
    scorer._stall_seconds = 1.0
    try:
        start = time.perf_counter()
        result = scorer.score(["q", "q"], ["hang", "7"], ["7", "7"])
        elapsed = time.perf_counter() - start
        later = scorer.score(["q"], ["7"], ["7"])
    finally:
        scorer.close()
    assert elapsed < 10.0
    assert result.components[name][0] == -1.0
    assert result.metrics["reward/timeouts"] >= 1.0
    assert later.scores == [1.0]


def test_scorer_reports_extra_dict_keys(user_module: str) -> None:
    name = f"{user_module}:with_extras"
    scorer = RewardScorer([(name, 2.0, {"bonus": 0.25})], timeout_seconds=5.0, fallback_score=0.0)
    try:
        result = scorer.score(["q", "q"], ["ab1", "2345"], ["", ""])
    finally:
        scorer.close()
    assert result.scores == [1.5, 1.5]
    assert result.components[f"{name}/length"] == [3.0, 4.0]
    assert result.components[f"{name}/digits"] == [1.0, 4.0]
    assert result.metrics[f"reward/{name}/digits/mean"] == pytest.approx(2.5)


def test_scorer_counts_invalid_results_as_failures(user_module: str) -> None:
    name = f"{user_module}:bad_result"
    scorer = RewardScorer([(name, 1.0, {})], timeout_seconds=5.0, fallback_score=0.125)
    try:
        result = scorer.score(["q", "q"], ["str", "nan"], ["", ""])
    finally:
        scorer.close()
    assert result.scores == [0.125, 0.125]
    assert result.metrics["reward/failures"] == 2.0


def test_scorer_runs_math_verify_in_its_workers() -> None:
    scorer = RewardScorer([("math_verify", 1.0, {})], timeout_seconds=10.0, fallback_score=-1.0)
    try:
        result = scorer.score(["q"] * 3, ["\\boxed{\\frac{1}{2}}", "$42$", "\\boxed{41}"], ["0.5", "42", "42"])
    finally:
        scorer.close()
    assert result.scores == [1.0, 1.0, 0.0]


def test_scorer_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        RewardScorer([("nope", 1.0, {})], timeout_seconds=1.0, fallback_score=0.0)
    with pytest.raises(ValueError, match="listed twice"):
        RewardScorer([("last_integer", 1.0, {}), ("last_integer", 1.0, {})], timeout_seconds=1.0, fallback_score=0.0)
    scorer = RewardScorer([("last_integer", 1.0, {})], timeout_seconds=1.0, fallback_score=0.0)
    with pytest.raises(ValueError, match="differ in length"):
        scorer.score(["q"], [], ["1"])
    scorer.close()
    with pytest.raises(RuntimeError, match="after close"):
        scorer.score(["q"], ["1"], ["1"])


def test_scorer_inside_a_ray_actor(ray_session) -> None:
    actor = ray.remote(RewardScorer).remote([("last_integer", 1.0, {})], 5.0, -1.0)
    prompts, responses, truths = demo_batch(16)
    result = ray.get(actor.score.remote(prompts, responses, truths), timeout=60)
    ray.get(actor.close.remote(), timeout=30)
    expected = [F.last_integer(p, r, t) for p, r, t in zip(prompts, responses, truths, strict=True)]
    assert result.scores == expected
    assert result.metrics["reward/failures"] == 0.0


def test_the_scorer_imports_no_torch() -> None:
    """The scorer's module is what its Ray actor, the pool's forkserver (its preload) and each pool worker import:
    torch and tensordict there cost ~150 MB of each process's memory (the demo's reward actor and its pool held
    ~600 MB PSS before) and ~5 s of start-up."""
    import subprocess

    probe = "import sys, rlstages.engines.rewards.scorer; print(sorted({'torch', 'tensordict'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
