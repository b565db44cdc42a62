"""Fixtures of the flow tests: the session's reference run, trained once and read by the training-flow tests,
the fault drills and the CLI tests (a test that would change it copies its directory first). Its tests share
the xdist group `reference-run` (tests/conftest.py), so one worker trains it once."""

from __future__ import annotations

from pathlib import Path

import pytest
from flow_support import Reference, tiny_cfg


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, ray_session, prefect_harness):
    """An uninterrupted 2-step run of tiny.yaml on Ray (run name `base`), its model logged to MLflow and
    registered as `tiny-policy`: what the other flow tests compare with."""
    from rlstages.flows.train import rl_post_train

    tmp = tmp_path_factory.mktemp("reference")
    cfg = tiny_cfg(tmp, tiny_model_dir, "base", "tracking.log_model=true", "tracking.registered_model_name=tiny-policy")
    policy = rl_post_train(cfg)
    return Reference(tmp, cfg, Path(policy))
