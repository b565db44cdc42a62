"""prefect.yaml, the work-pool twin of `rlstages deploy`: its `cfg` parameters are the presets they name (so they
cannot drift), and `prefect deploy --all` registers every deployment on a real `prefect server` with its cron
schedule, a concurrency limit of 1, the work pool, and a parameter schema the server enforces (a bad config is
refused before any run exists). No worker runs them here; the served deployments are run in test_deployments.py.

CPU only, about 30-60 s: `pytest tests/integration/test_prefect_yaml.py`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from integration_support import BIN, REPO, base_env

from rlstages.configs import RunConfig, load_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
PRESETS = {  # deployment -> (preset, overrides), as the comments in prefect.yaml say
    "tiny-nightly": ("configs/tiny.yaml", ["checkpoint.resume=fresh"]),
    "demo-weekly": ("configs/demo.yaml", []),
}


def declared() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}


def test_declared_parameters_are_the_presets() -> None:
    deployments = declared()
    assert set(deployments) == set(PRESETS)
    for name, (preset, overrides) in PRESETS.items():
        d = deployments[name]
        assert RunConfig.model_validate(d["parameters"]["cfg"]) == load_config(REPO / preset, overrides), name
        assert d["concurrency_limit"]["limit"] == 1
        assert d["entrypoint"] == "flows/train.py:rl_post_train"


def test_prefect_deploy_registers_them_with_schedule_limit_and_schema(servers, prefect_api, tmp_path: Path) -> None:
    env = base_env(PREFECT_API_URL=servers.prefect_api, PREFECT_HOME=str(tmp_path / "prefect-client"), PWD=str(REPO))
    prefect = str(BIN / "prefect")
    for cmd in (
        [prefect, "work-pool", "create", "rlstages-local", "--type", "process", "--overwrite"],
        [prefect, "--no-prompt", "deploy", "--all"],
    ):
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{' '.join(cmd[1:])}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    for name, spec in declared().items():
        d = prefect_api.deployment(name)
        assert d is not None, name
        assert [s["schedule"]["cron"] for s in d["schedules"]] == [spec["schedules"][0]["cron"]]
        assert d["global_concurrency_limit"]["limit"] == 1
        assert d["concurrency_options"]["collision_strategy"] == spec["concurrency_limit"]["collision_strategy"]
        assert d["work_pool_name"] == "rlstages-local" and d["enforce_parameter_schema"]
        assert d["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "60"
        assert d["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(REPO)
        assert "RunConfig" in d["parameter_openapi_schema"]["definitions"]

    tiny = prefect_api.deployment("tiny-nightly")

    def asked_for() -> int:  # runs created by a request, not those the server's scheduler adds for the cron
        return sum(not r["auto_scheduled"] for r in prefect_api.runs_of(tiny["id"]))

    before = asked_for()
    bad = {
        "parameters": {"cfg": {**declared()["tiny-nightly"]["parameters"]["cfg"], "trainer": {"total_steps": "many"}}}
    }
    resp = prefect_api.post(f"deployments/{tiny['id']}/create_flow_run", bad)
    assert resp.status_code in (409, 422), resp.text  # the UI form's validation, server side
    assert "total_steps" in resp.text
    assert asked_for() == before  # refused before any run existed
