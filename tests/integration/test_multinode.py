"""Multi-node Ray and `rlstages doctor`: a local two-node cluster (`ray start --head` with `rollout_node`, a second
`ray start --address` with `trainer_node`, both on this machine, 1 CPU each), the training flow run against it
through `rlstages run` in a subprocess with RAY_ADDRESS (the pytest process's Ray is untouched), the rollout and
trainer groups placed on different nodes; then the doctor reports that cluster, the servers and the backends.

CPU only, about 2-3 minutes: `pytest tests/integration/test_multinode.py`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_support import REPO, RLSTAGES, TINY, base_env, tiny_overrides
from mlflow import MlflowClient

from rlstages.flows.cli import doctor

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Reads the GCS actor table (dead actors included: the run killed its groups when it ended) and each node's
# custom resources. Runs in a subprocess so that this pytest process never connects to the cluster.
_PLACEMENT = """
import json, os, ray
from ray._private import state
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.endswith("_node")) for n in ray.nodes()}
actors = [{"name": a["Name"], "state": a["State"], "node": a["Address"]["NodeID"]} for a in state.actors().values()]
print(json.dumps({"nodes": nodes, "actors": actors}))
"""


def test_rollout_and_trainer_groups_run_on_different_nodes(ray_cluster, servers, tiny_model_dir, tmp_path) -> None:
    overrides = tiny_overrides(
        tmp_path,
        tiny_model_dir,
        servers.mlflow_uri,
        "two-nodes",
        "it-multinode",
        "trainer.total_steps=1",
        "cluster.rollout_resources={rollout_node: 1}",
        "cluster.trainer_resources={trainer_node: 1}",
    )
    env = base_env(
        RAY_ADDRESS=ray_cluster.address,
        PREFECT_API_URL=servers.prefect_api,
        PREFECT_HOME=str(tmp_path / "prefect-client"),
    )
    run = subprocess.run([RLSTAGES, "run", TINY, *overrides], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    probe = subprocess.run(
        [sys.executable, "-c", _PLACEMENT],
        env=base_env(RAY_ADDRESS=ray_cluster.address),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    info = json.loads([line for line in probe.stdout.splitlines() if line.startswith("{")][-1])
    assert sorted(map(tuple, info["nodes"].values())) == [("rollout_node",), ("trainer_node",)]
    placed = {
        a["name"].split("-")[-1]: info["nodes"].get(a["node"]) for a in info["actors"] if "two-nodes-" in a["name"]
    }
    assert placed.get("rollout:0") == ["rollout_node"], placed
    assert placed.get("actor:0") == ["trainer_node"], placed
    assert "reward:0" in placed  # the reward scorer has no custom resource: either node

    client = MlflowClient(servers.mlflow_uri)
    exp = client.get_experiment_by_name("it-multinode")
    (mlflow_run,) = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'two-nodes'")
    assert mlflow_run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "reward/mean")] == [1]


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
    ok, text = doctor._run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import clash"], 60
    )
    assert not ok and "needs torch<2.0" in text
    row = doctor._train_row("training deepspeed", (ok, text), "ZeRO", "deepspeed")
    assert row.ok is False and row.detail.startswith("import failed (version clash?)")
    unreachable = doctor.prefect_endpoint("http://127.0.0.1:9/api")[0]
    assert unreachable.ok is False
    assert doctor.mlflow_endpoint("http://127.0.0.1:9")[0].ok is False
    assert doctor.ray_cluster(None)[0].ok is None  # no cluster: a run starts its own local Ray
