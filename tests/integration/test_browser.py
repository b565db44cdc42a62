"""What people look at, checked in a real browser: two 2-step runs of the tiny preset against the session's real
`prefect server` and `mlflow server` (tests/integration/conftest.py), the first with a transient fault at
`generate@2` (retried in place), then headless Chromium (Debian's, driven by playwright) opens

- the MLflow run page: params, the `reward/mean` chart fed one point per step, the reward-curve PNG and the
  samples table among the artifacts;
- MLflow's compare view of the two runs;
- the Prefect flow-run page: task runs named by stage and step, the retried `generate[step=2]`, the link
  artifact to the MLflow run, the run log (one line per step, the retry);
- the self-contained page of `rlstages compare --html` from a file (no server).

Assertions read page content (text, the UI's own API responses), never pixels. Screenshots are test output in
`test-output/browser/` (two of them are in docs/). CPU only; a few minutes: `pytest tests/integration/test_browser.py`.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from integration_support import REPO, RLSTAGES, TINY, PrefectAPI, Servers, base_env, tiny_overrides
from mlflow import MlflowClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]
EXPERIMENT = "it-browser"
SHOTS = REPO / "test-output" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
UI_TIMEOUT_MS = 120_000  # the servers share two loaded cores with everything else


@dataclass(frozen=True)
class Run:
    """One finished training run: its MLflow run and its Prefect flow run."""

    name: str
    mlflow_run_id: str
    experiment_id: str
    flow_run_id: str


def train(servers: Servers, workdir: Path, model_dir: Path, name: str, faults: str, *extra: str) -> Run:
    """`rlstages run configs/tiny.yaml` against the servers, the engines in the run's process; the run's ids."""
    overrides = tiny_overrides(workdir, model_dir, servers.mlflow_uri, name, EXPERIMENT, *extra)
    env = base_env(
        PREFECT_API_URL=servers.prefect_api,
        PREFECT_HOME=str(workdir / "prefect-client"),
        RLSTAGES_FAULTS=faults,
    )
    proc = subprocess.run(
        [RLSTAGES, "run", TINY, *overrides, "cluster.mode=in_process"],  # the pages are the point, not Ray
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, f"rlstages run {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    shown = proc.stdout + proc.stderr  # the terminal: the run's own lines (libraries' output went to its log file)
    assert re.search(r"step 2/2 reward [-\d.]+ kl \S+ tokens/s [\d,]+ time [\d.]+s", shown), shown[-3000:]
    client = MlflowClient(servers.mlflow_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None
    (found,) = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    return Run(name, found.info.run_id, exp.experiment_id, found.data.tags["rlstages.prefect_flow_run_id"])


@pytest.fixture(scope="module")
def runs(servers: Servers, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    """Run A (a transient fault in generate at step 2, retried) and run B (another learning rate)."""
    work = tmp_path_factory.mktemp("browser")
    a = train(servers, work, tiny_model_dir, "browser-a", "generate@2:transient")
    b = train(servers, work, tiny_model_dir, "browser-b", "", "actor.optim.lr=5e-4")
    return a, b


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium through playwright (no `playwright install`: the system browser)."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), "Chromium missing: `make setup-test` runs scripts/browser_env.sh"
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page, 1400x900, with the UI timeout."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(UI_TIMEOUT_MS)
    yield pg
    context.close()


def shot(page: Any, name: str) -> Path:
    """Save a full-page screenshot as test output."""
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def body(page: Any) -> str:
    """The visible text of the page."""
    return page.inner_text("body")


def model_training_view(page: Any, base: str) -> None:
    """Switch the MLflow UI from its GenAI view to the model-training one (the UI remembers it)."""
    page.goto(f"{base}/#/")
    page.get_by_text("Model training", exact=True).first.click()
    page.wait_for_timeout(1000)


def test_mlflow_run_page_shows_params_metrics_and_artifacts(runs: tuple[Run, Run], servers: Servers, page) -> None:
    a, _ = runs
    base = servers.mlflow_uri.rstrip("/")
    run_url = f"{base}/#/experiments/{a.experiment_id}/runs/{a.mlflow_run_id}"
    histories: list[dict[str, Any]] = []

    images: list[str] = []

    def record(response: Any) -> None:  # the chart's own data requests, the PNG the preview loads
        if "metrics/get-history" in response.url and "reward%2Fmean" in response.url and response.ok:
            histories.append(response.json())
        if "reward_curve.png" in response.url and response.ok:
            images.append(response.headers.get("content-type", ""))

    page.on("response", record)
    model_training_view(page, base)
    page.goto(run_url)
    page.get_by_text("actor.optim.lr").first.wait_for()
    text = body(page)
    assert a.name in text and "rlstages.algorithm" in text and "Finished" in text
    assert "actor.optim.lr" in text and "rollout.n" in text  # params: the flattened config
    shot(page, "mlflow-run-overview")

    page.goto(f"{run_url}/model-metrics")
    page.get_by_placeholder("Search metric charts").fill("reward/mean")
    page.get_by_text(f"{a.name} (reward/mean)").first.wait_for()  # the chart's legend
    page.wait_for_timeout(2000)
    shot(page, "mlflow-run-reward-chart")
    points = [(int(m["step"]), m["run_id"]) for h in histories for m in h.get("metrics", [])]
    assert sorted(set(points)) == [(1, a.mlflow_run_id), (2, a.mlflow_run_id)], points  # one point per step
    assert len(points) == 2 * len(histories)

    page.goto(f"{run_url}/artifacts")
    page.get_by_text("plots", exact=True).first.click()
    page.get_by_text("reward_curve.png").first.click()
    page.wait_for_timeout(3000)
    assert any(kind.startswith("image/png") for kind in images), images  # the reward-curve PNG, previewed
    page.get_by_text("eval", exact=True).first.click()
    page.get_by_text("samples_step_000002.json").first.click()
    page.get_by_text("ground_truth").first.wait_for()  # the samples table's columns
    text = body(page)
    assert "response" in text and "score" in text
    shot(page, "mlflow-run-artifacts")


def test_mlflow_compare_view_shows_both_runs(runs: tuple[Run, Run], servers: Servers, page) -> None:
    a, b = runs
    base = servers.mlflow_uri.rstrip("/")
    ids = json.dumps([a.mlflow_run_id, b.mlflow_run_id], separators=(",", ":"))
    model_training_view(page, base)
    page.goto(f"{base}/#/compare-runs?runs={ids}&experiments={json.dumps([a.experiment_id])}")
    page.get_by_text("actor.optim.lr").first.wait_for()
    page.get_by_text("Show diff only").first.click()
    page.wait_for_timeout(1500)
    text = body(page)
    assert a.mlflow_run_id in text and b.mlflow_run_id in text and a.name in text and b.name in text
    assert re.search(r"actor\.optim\.lr\s+0\.001\s+0\.0005|actor\.optim\.lr\s+0\.0005\s+0\.001", text), text[:3000]
    assert "rollout.n\t" not in text  # equal params are hidden by "Show diff only"
    shot(page, "mlflow-compare")


def test_prefect_flow_run_page_shows_named_task_runs_retry_link_and_logs(
    runs: tuple[Run, Run], servers: Servers, prefect_api: PrefectAPI, page
) -> None:
    a, _ = runs
    ui = servers.prefect_api.removesuffix("/api").rstrip("/")
    page.goto(f"{ui}/runs/flow-run/{a.flow_run_id}")
    page.get_by_text(re.compile(r"step 2/2 reward")).first.wait_for()  # the log pane: one line per step
    text = body(page)
    assert a.name in text and "Completed" in text
    assert "step 1/2 reward" in text and "checkpoint of step 2 committed" in text
    assert "generate[step=2] failed (ConnectionError: injected transient fault" in text and "transient: retried" in text
    shot(page, "prefect-flow-run")

    page.get_by_text("Task Runs", exact=True).first.click()
    page.get_by_text("generate[step=2]").first.wait_for()
    text = body(page)
    for stage in ("generate", "score_rewards", "advantages", "update_actor", "sync_weights", "checkpoint"):
        assert f"{stage}[step=1]" in text and f"{stage}[step=2]" in text, stage
    assert "export_policy" in text and "prepare_run" in text
    shot(page, "prefect-flow-run-task-runs")

    (retried,) = [t for t in prefect_api.task_runs(a.flow_run_id) if t["name"] == "generate[step=2]"]
    page.goto(f"{ui}/runs/task-run/{retried['id']}")
    page.get_by_text("Run Count").first.wait_for()
    page.get_by_text(re.compile(r"Retry 1/\d")).first.wait_for()  # the task run's own log
    text = body(page)
    assert re.search(r"Run Count\s+2\b", text), text[:3000]  # failed once, ran again
    assert "Retry 1/" in text
    shot(page, "prefect-retried-task-run")

    page.goto(f"{ui}/runs/flow-run/{a.flow_run_id}")
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text(f"mlflow-{a.name}").first.click()  # the link artifact's card, then its page
    link = page.locator(f"a:has-text('MLflow run {a.mlflow_run_id}')").first
    link.wait_for()
    href = link.get_attribute("href")
    assert href == f"{servers.mlflow_uri.rstrip('/')}/#/experiments/{a.experiment_id}/runs/{a.mlflow_run_id}"
    shot(page, "prefect-flow-run-artifacts")


def test_compare_html_opens_without_a_server(runs: tuple[Run, Run], servers: Servers, tmp_path: Path, page) -> None:
    a, b = runs
    out = tmp_path / "compare.html"
    proc = subprocess.run(
        [RLSTAGES, "compare", EXPERIMENT, "--tracking-uri", servers.mlflow_uri, "--html", str(out)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    html = out.read_text()
    assert "<script" not in html and not re.search(r'(src|href)="https?:', html)  # self-contained: nothing loads
    page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    page.goto(out.as_uri())
    text = body(page)
    assert a.name in text and b.name in text
    diff = page.inner_text("#config-diff")
    assert "actor.optim.lr" in diff and "0.0005" in diff
    assert page.locator("figure svg").count() >= 1  # the overlaid curves, inline
    legend = page.locator("figure").first.text_content() or ""  # the SVG keeps its text as text
    assert a.name in legend and b.name in legend
    shot(page, "compare-html")
