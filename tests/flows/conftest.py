"""Fixtures of the flow tests: the session's reference run, trained once and read by the training-flow tests,
the fault drills and the CLI tests (a test that would change it copies its directory first). Its tests share
the xdist group `reference-run` (tests/conftest.py), so one worker trains it once; under scripts/run_tests.py it
is kept in the directory the tiers share (RLSTAGES_TEST_SHARED), so the serial tier reads the parallel tier's."""

from __future__ import annotations

from pathlib import Path

import pytest
from flow_support import Reference, run_dir, tiny_cfg
from session_cache import built_once, mlflow_store, shared_or


@pytest.fixture(scope="session")
def reference_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, prefect_harness
) -> Reference:
    """An uninterrupted 2-step run of tiny.yaml on Ray (run name `base`), its model logged to MLflow and
    registered as `tiny-policy`: what the other flow tests compare with. Trained once (Ray starts only then); a
    pytest run that finds it finished in the shared directory reads it (its Prefect flow run is in the Prefect
    API of the session that trained it)."""
    tmp = shared_or("reference", None) or tmp_path_factory.mktemp("reference")
    cfg = tiny_cfg(tmp, tiny_model_dir, "base", "tracking.log_model=true", "tracking.registered_model_name=tiny-policy")

    def train(_: Path) -> dict[str, str]:
        from rlstages.flows.train import rl_post_train

        request.getfixturevalue("ray_session")
        mlflow_store(tmp)  # again: `built_once` emptied the folder
        return {"policy": str(rl_post_train(cfg))}

    done = built_once(tmp, train)
    return Reference(tmp, cfg, Path(done.get("policy", run_dir(cfg) / "final")))
