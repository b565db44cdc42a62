"""`rlstages doctor` against a local two-node Ray cluster (`ray start --head` with `rollout_node`, a second
`ray start --address` with `trainer_node`, both on this machine, 1 CPU each; the session's `ray_cluster`, where the
deployment tests' runs go too), the session's Prefect and MLflow servers and the installed backends; and what it says
when something is missing. Training across nodes (groups pinned to nodes by custom resources, on separate IPs) is
`tests/cluster/test_sim_cluster.py`'s.

CPU only, under a minute: `pytest tests/integration/test_multinode.py`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from integration_support import REPO

from rlstages.flows.cli import doctor, doctor_probes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_doctor_reports_the_cluster_the_servers_and_the_backends(ray_cluster, servers) -> None:
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(doctor.doctor_command)
    args = ["--json", "--timeout", "150", "--ray-address", ray_cluster.address]
    args += ["--prefect-url", servers.prefect_api, "--tracking-uri", servers.mlflow_uri]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    checks = {(c["section"], c["name"]): c for c in json.loads(result.stdout)}

    cluster = checks[("ray", "cluster")]
    assert cluster["ok"] and "2 nodes" in cluster["detail"], cluster
    assert "rollout_node=4" in cluster["detail"] and "trainer_node=4" in cluster["detail"]
    assert checks[("prefect", "api")]["ok"] and "server 3.8.8" in checks[("prefect", "api")]["detail"]
    assert checks[("mlflow", "tracking")]["ok"]
    assert checks[("versions", "torch")]["detail"] == torch.__version__

    assert checks[("backends", "gpu")]["ok"] is torch.cuda.is_available()
    assert checks[("backends", "rollout hf")]["ok"] and checks[("backends", "training torch")]["ok"]
    sglang = checks[("backends", "rollout sglang")]
    if importlib.util.find_spec("sglang") is None:
        assert sglang["ok"] is False and "not installed" in sglang["detail"]
    for name, module in (("training deepspeed", "deepspeed"), ("training megatron", "megatron")):
        row = checks[("backends", name)]
        assert row["ok"] is (importlib.util.find_spec(module) is not None), row
    vllm = checks[("backends", "rollout vllm")]
    if not (REPO / ".venv-vllm" / "bin" / "python").is_file() and importlib.util.find_spec("vllm") is None:
        assert vllm["ok"] is False and "make vllm-env" in vllm["detail"]
    else:
        assert "vllm" in vllm["detail"]


def test_doctor_says_why_not(tmp_path: Path) -> None:
    broken = tmp_path / "clash.py"
    broken.write_text("raise ImportError('needs torch<2.0, found 2.13')\n")
    ok, text = doctor_probes._run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import clash"], 60
    )
    assert not ok and "needs torch<2.0" in text
    row = doctor_probes._train_row("training deepspeed", (ok, text), "ZeRO", "deepspeed")
    assert row.ok is False and row.detail.startswith("import failed (version clash?)")
    unreachable = doctor_probes.prefect_endpoint("http://127.0.0.1:9/api")[0]
    assert unreachable.ok is False
    assert doctor_probes.mlflow_endpoint("http://127.0.0.1:9")[0].ok is False
    assert doctor_probes.ray_cluster(None)[0].ok is None  # no cluster: a run starts its own local Ray
