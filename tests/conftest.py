"""Shared fixtures: an isolated environment, a tiny model built from a config, one local Ray and one
Prefect test harness per session. Runs on a CPU; `make test` runs everything CI runs (tests/README.md).

Under pytest-xdist each worker is its own session: its own temporary directory, PREFECT_HOME, Ray and Prefect
harness. The hooks at the end group a module's tests on one worker where they share a module-scoped fixture,
mark the tests that must own the machine `serial`, and report (never fail) tests over the time budget."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from session_cache import built_once, shared_or

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="rlstages-tests-"))
# An xdist worker inherits the controller's environment: a PREFECT_HOME this file set there is replaced by the
# worker's own (two workers never share one), while a PREFECT_HOME the user set is kept.
_PARENT_TMP = os.environ.get("RLSTAGES_TESTS_TMP")
if _PARENT_TMP and os.environ.get("PREFECT_HOME") == str(Path(_PARENT_TMP) / "prefect"):
    del os.environ["PREFECT_HOME"]
os.environ["RLSTAGES_TESTS_TMP"] = str(_SESSION_TMP)
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect"))
for key, value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "MLFLOW_ENABLE_ASYNC_LOGGING": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    """A temporary directory shared by the whole session."""
    return _SESSION_TMP


@pytest.fixture(scope="session")
def tiny_model_dir(session_tmp: Path) -> Path:
    """A random-init Qwen2 (hidden 64, 2 layers, GQA 4/2, QKV bias) with a char tokenizer, saved once (in the
    directory the tiers share, if set)."""
    from rlstages.engines.models import build_tiny_model

    path = shared_or("tiny-qwen2", session_tmp / "tiny-qwen2")
    built_once(path, build_tiny_model)
    return path


@pytest.fixture(scope="session")
def tiny_vlm_dir(session_tmp: Path) -> Path:
    """A random-init Qwen2-VL (text: hidden 64, 2 layers; vision: one block of width 32) with a char tokenizer
    plus the vision tokens and its image processor (56x56..112x112 pixels), saved once (in the directory the tiers
    share, if set)."""
    from rlstages.engines.models import build_tiny_model

    path = shared_or("tiny-qwen2-vl", session_tmp / "tiny-qwen2-vl")
    built_once(path, lambda p: build_tiny_model(p, model_type="qwen2_vl"))  # type: ignore[arg-type]
    return path


TINY_MOE = {  # a tiny Qwen3-MoE: hidden 32, 2 layers, 4 routed experts (top-2), every layer MoE
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


@pytest.fixture(scope="session")
def tiny_moe_dir(session_tmp: Path) -> Path:
    """A random-init Qwen3-MoE (`TINY_MOE`) with a char tokenizer, saved once (one tensor per expert)."""
    from rlstages.engines.models import build_tiny_model

    path = shared_or("tiny-qwen3-moe", session_tmp / "tiny-qwen3-moe")
    built_once(path, lambda p: build_tiny_model(p, **TINY_MOE))  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="session")
def tiny_deepseek_dir(session_tmp: Path) -> Path:
    """A random-init DeepSeek-V3 (hidden 32, 3 layers: the dense first one, then two with 4 routed experts (top-2)
    and a shared expert; Multi-head Latent Attention) with a char tokenizer, saved once."""
    from rlstages.engines.models import build_tiny_model

    path = shared_or("tiny-deepseek-v3", session_tmp / "tiny-deepseek-v3")
    deepseek = {**TINY_MOE, "model_type": "deepseek_v3", "num_hidden_layers": 3}
    built_once(path, lambda p: build_tiny_model(p, **deepseek))  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the session (2 CPUs, no dashboard; token auth on, 127.0.0.1 only)."""
    import ray

    from rlstages.tasks.driver.ray_auth import init_local_ray

    if not ray.is_initialized():
        init_local_ray(num_cpus=2, include_dashboard=False, namespace="rlstages-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_harness():
    """Real Prefect with no server: one temporary SQLite-backed API for the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# --- the harness: xdist groups, the serial tier, the time budget (tests/README.md) ---

BUDGET_S = 90.0  # a test outside `slow` / `integration` should take less on CI's two cores
DURATIONS_ENV = "RLSTAGES_TEST_RECORD"  # set by scripts/run_tests.py: where each pytest run appends its records
TIER_ENV = "RLSTAGES_TEST_TIER"  # `fast` (make test-fast): leave out every test that starts Ray, Prefect or servers
_SERVER_FIXTURES = {"ray_session", "prefect_harness", "servers", "ray_cluster", "sim_cluster"}
# A costly session fixture read by tests in several files: its tests share one xdist group, so one worker builds it
# (the simulated cluster and the servers: `make test`'s integration tier runs these two groups side by side).
SHARED_GROUPS = {
    "reference_run": "reference-run",
    "sim_cluster": "sim-cluster",
    "servers": "servers",
    "ray_cluster": "servers",
}
_durations: dict[str, float] = {}
_exempt: set[str] = set()


def pytest_itemcollected(item: pytest.Item) -> None:
    """`integration` tests are `serial`. A test that uses a fixture of SHARED_GROUPS gets its group; one that uses
    a module- or class-scoped fixture gets its module's xdist group (one worker computes the fixture once), unless
    it names a group itself; every other test is load-balanced, so a new test file needs no edit to run under
    `pytest -n 2 --dist loadgroup`. (Marked here, as each test is collected: xdist turns the groups into node-id
    suffixes in its own pytest_collection_modifyitems.)"""
    if item.get_closest_marker("integration") is not None and item.get_closest_marker("serial") is None:
        item.add_marker(pytest.mark.serial)
    if item.get_closest_marker("xdist_group") is not None:
        return
    names = set(getattr(item, "fixturenames", ()))
    shared = sorted({SHARED_GROUPS[f] for f in names if f in SHARED_GROUPS})
    if shared:
        item.add_marker(pytest.mark.xdist_group(name="+".join(shared)))
        return
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else []
    if any(d.scope in ("module", "class") for fixture_defs in defs for d in fixture_defs):
        item.add_marker(pytest.mark.xdist_group(name=item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The xdist group suffixes (`_xdist_group_suffix`); with RLSTAGES_TEST_TIER=fast, deselect every test that is
    serial or starts Ray, Prefect or a server."""
    _xdist_group_suffix(config, items)
    _heavy_singletons_first(config, items)
    if os.environ.get(TIER_ENV) != "fast":
        return
    heavy = [
        i
        for i in items
        if i.get_closest_marker("serial")
        or i.get_closest_marker("integration")
        or _SERVER_FIXTURES & set(getattr(i, "fixturenames", ()))
    ]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        left = set(heavy)
        items[:] = [i for i in items if i not in left]


# a load-balanced test that starts Ray, Prefect or a backend engine runs for tens of seconds, a unit test for less
# than one: the long ones are handed out first, so the tier does not end on one worker's long test
_LONG_FIXTURES = {"ray_session", "prefect_harness", "tiny_vlm_dir"}
_LONG_PATHS = ("megatron", "deepspeed", "vllm", "sglang", "tests/flows/")


def _heavy_singletons_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under loadgroup, xdist hands out its groups first (largest first), then each remaining test alone, in
    collection order: move the long ones among those (`_LONG_FIXTURES`, `_LONG_PATHS`) to the front of them, each
    in its own slot among the grouped tests, which keep their places (a module's fixture is set up once)."""
    if not getattr(config.option, "loadgroup", False):
        return
    slots = [n for n, item in enumerate(items) if item.get_closest_marker("xdist_group") is None]

    def long_first(item: pytest.Item) -> bool:
        path = item.nodeid.split("::", 1)[0]
        uses = set(getattr(item, "fixturenames", ()))
        return not (uses & _LONG_FIXTURES or any(part in path for part in _LONG_PATHS))

    ordered = sorted((items[n] for n in slots), key=long_first)  # stable: collection order within each kind
    for n, item in zip(slots, ordered, strict=True):
        items[n] = item


def _xdist_group_suffix(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-xdist's loadgroup schedules by an `@group` suffix of the node id that its worker sets as `_nodeid`;
    pytest >= 9 keeps the id in `_id`, so the suffix would be lost (and each group split over the workers):
    set it there where xdist's did not take."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if "@" in item.nodeid:
            continue
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        if names and hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id  # pytest >= 9

            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(names))}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up setup, call and teardown per test (in the xdist controller too: it receives every report)."""
    key = report.nodeid
    _durations[key] = _durations.get(key, 0.0) + report.duration
    if "slow" in report.keywords or "integration" in report.keywords:
        _exempt.add(key)


def pytest_deselected(items: list[pytest.Item]) -> None:
    """With RLSTAGES_TEST_RECORD set, note the files of the tests this run leaves out (its `-m`) beside the record:
    scripts/run_tests.py's later tiers collect only those files (collecting the whole tree costs ~20 s a process)."""
    record = os.environ.get(DURATIONS_ENV)
    if record and items:
        files = sorted({item.nodeid.split("::", 1)[0] for item in items})
        with open(f"{record}.deselected", "a", encoding="utf-8") as fh:  # xdist: each worker appends the same
            fh.write("".join(f"{f}\n" for f in files))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """List (never fail) the tests outside `slow` / `integration` over BUDGET_S; with RLSTAGES_TEST_RECORD set,
    append this run's durations and outcome counts there for scripts/run_tests.py's combined report."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    over = sorted(
        ((d, k) for k, d in _durations.items() if d > BUDGET_S and k not in _exempt),
        reverse=True,
    )
    if over:
        terminalreporter.write_sep("-", f"over the {BUDGET_S:.0f} s budget (a report, not a failure)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
    record = os.environ.get(DURATIONS_ENV)
    if record:
        counts = {k: len(v) for k, v in terminalreporter.stats.items() if k and k != "warnings"}
        entry = {"exitstatus": int(exitstatus), "counts": counts, "durations": _durations, "exempt": sorted(_exempt)}
        with open(record, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")
