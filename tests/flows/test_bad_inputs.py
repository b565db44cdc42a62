"""Bad input at the command line, table-driven: every case exits 2 with one line naming the field or file, and
leaves every pre-existing file (run directories, checkpoints, the MLflow database and its FINISHED run)
byte-for-byte as it was, with no new run directory, MLflow store or artifact folder. The commands run
in-process (typer's CliRunner); all of them fail in the pre-flight, before a run directory, Ray, Prefect or
MLflow starts. What a run would find out late is rehearsed there (LoRA targets on a meta-device model, the
tracking store, the GPUs and CPUs of a local cluster, local data paths), and `config show` refuses every
input that `run` refuses (the same pre-flight)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bad_input_cases import CONFIG_CASES
from bad_input_workspace import (
    IMAGES,
    LOCAL_RAY,
    LORA,
    PARQUET,
    TRACKING,
    VLM,
    B,
    build_workspace,
    jsonl_config,
    snapshot,
)
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_vlm_dir: Path) -> Iterator[Path]:
    """A working directory holding a finished run (MLflow FINISHED), damaged runs, bad models and data files."""
    work = tmp_path_factory.mktemp("bad-inputs")
    old = Path.cwd()
    os.chdir(work)
    try:
        build_workspace(work, tiny_model_dir, tiny_vlm_dir)
        yield work
    finally:
        os.chdir(old)


# (case id, argv, environment, text the one line must contain): the config and what it names
# (tests/flows/bad_input_cases.py), then what a run used to find out late, rehearsed in the pre-flight now
CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    *CONFIG_CASES,
    # found late before, rehearsed in the pre-flight now: LoRA targets (the PEFT wrapper on the meta device)
    ("lora-target", ["run", B, LORA % "nope_proj"], {}, "model.lora.target_modules: ['nope_proj'] are not linear"),
    ("lora-target-typo", ["run", B, "model.lora={target_modules: [qproj]}"], {}, "['qproj'] are not linear layers"),
    ("lora-target-norm", ["run", B, LORA % "input_layernorm"], {}, "['input_layernorm'] are not linear layers"),
    # ... the tracking store, named by where its URI comes from
    ("tracking-scheme", ["run", B, "tracking.tracking_uri=foo://bar"], {}, "tracking.tracking_uri: foo://bar has an"),
    (
        "tracking-env-scheme",
        ["run", B, "tracking.tracking_uri=null"],
        {"MLFLOW_TRACKING_URI": "nope://x"},
        "MLFLOW_TRACKING_URI: nope://x has an unknown scheme 'nope'",
    ),
    (
        "tracking-under-a-file",
        ["run", B, "tracking.tracking_uri=sqlite:///a-file/mlflow.db"],
        {},
        "tracking.tracking_uri: sqlite:///a-file/mlflow.db cannot be created",
    ),
    (
        "tracking-env-under-a-file",
        ["run", B, "tracking.tracking_uri=null"],
        {"MLFLOW_TRACKING_URI": "sqlite:///a-file/sub/mlflow.db"},
        "MLFLOW_TRACKING_URI: sqlite:///a-file/sub/mlflow.db cannot be created",
    ),
    ("tracking-db-is-dir", ["run", B, "tracking.tracking_uri=sqlite:///foreign"], {}, "foreign, which is a directory"),
    ("tracking-not-sqlite", ["run", B, "tracking.tracking_uri=sqlite:///a-file"], {}, "not an SQLite database"),
    ("tracking-file-store", ["run", B, "tracking.tracking_uri=./mlruns"], {}, "./mlruns is a file store"),
    ("tracking-no-host", ["run", B, "tracking.tracking_uri=http://"], {}, "has no host"),
    # ... the GPUs and CPUs of a cluster whose resources are known before it starts (said before Prefect and Ray)
    ("cluster-gpus", ["run", B, "cluster.num_gpus=64"], LOCAL_RAY, "cluster.num_gpus: 64 GPUs asked for"),
    (
        "cluster-gpus-in-process",
        ["run", B, "cluster.mode=in_process", "cluster.num_gpus=64"],
        {},
        "cluster.num_gpus: 64 GPUs asked for",
    ),
    (
        "cluster-cpus",
        ["run", B, "cluster.num_cpus=2", "cluster.placement_group=true", "cluster.cpus_per_bundle=3"],
        LOCAL_RAY,
        "cluster.cpus_per_bundle: the placement groups reserve 3 CPUs",
    ),
    (
        "cluster-cpus-split",
        ["run", B, "cluster.num_cpus=2", "cluster.placement_group=true", "cluster.colocate=false"]
        + ["cluster.cpus_per_bundle=1.5"],
        LOCAL_RAY,
        "reserve 3 CPUs (2 x 1.5 per bundle)",
    ),
    # ... data paths that can only be local files are missing files, not hub dataset names
    ("datasets-suffix", ["run", B, "data.source={kind: datasets, path: data/none.parquet}"], {}, "none.parquet does"),
    ("datasets-dot", ["run", B, "data.source={kind: datasets, path: ./nowhere}"], {}, "path: ./nowhere does not"),
    ("datasets-abs", ["run", B, "data.source={kind: datasets, path: /no/such/train}"], {}, "/no/such/train does not"),
    ("datasets-glob", ["run", B, "data.source={kind: datasets, path: 'data/*.parquet'}"], {}, "matches no file"),
    (
        "datasets-eval",
        ["run", B, "data.source={kind: datasets, path: data/good.jsonl, eval_path: ../none.csv}"],
        {},
        "data.source.eval_path: ../none.csv does not exist",
    ),
    ("jsonl-is-dir", ["run", B, jsonl_config(Path("data"))], {}, "data.source.train_path: data is a directory"),
    # ... images (verl's schema): one that does not open, placeholders != images, too many, image tokens past the
    # limit, a model without an image processor or without a vision tower, a backend that has no image path yet
    (
        "image-broken",
        ["run", B, VLM, IMAGES % "img-broken"],
        {},
        "column 'images': image 0 (data/broken.png) does not open as an image (not in an image format PIL reads)",
    ),
    (
        "image-bytes-broken",
        ["run", B, VLM, "data.source={kind: datasets, path: data/verl/img-bad.parquet}"],
        {},
        "column 'images': image 0 (bytes in the cell) does not open as an image",
    ),
    (
        "image-path-climbs-out",
        ["run", B, VLM, IMAGES % "img-climbs"],
        {},
        "-outside.png climbs out of the data directory",
    ),
    (
        "image-parquet-text-model-unbuilt",  # verl's image parquet, a text model its provider has not built yet
        ["run", B, "model.provider=tiny-random", "model.path=models/unbuilt", PARQUET],
        {},
        "model.path: models/unbuilt is a qwen2 model, not a vision-language one",
    ),
    ("image-parquet-text-model", ["run", B, PARQUET], {}, "is a qwen2 model, not a vision-language one"),
    (
        "freeze-vision-tower-text-model",
        ["run", B, "actor.freeze=[vision_tower]"],
        {},
        "actor.freeze: ['vision_tower'] are not parts of model.path",
    ),
    (
        "freeze-every-part",
        ["run", B, VLM, "actor.freeze=[vision_tower, projector, language_model]"],
        {},
        "freezes every part of the qwen2_vl model: nothing trains",
    ),
    ("image-missing", ["run", B, VLM, IMAGES % "img-missing"], {}, "data/nowhere.png does not exist"),
    ("image-count", ["run", B, VLM, IMAGES % "img-count"], {}, "2 <image> placeholder(s) but 1 image(s)"),
    ("image-many", ["run", B, VLM, IMAGES % "img-many"], {}, "5 images > data.max_images_per_prompt=4"),
    (
        "image-tokens-cut",
        ["run", B, VLM, IMAGES % "img-good", "data.max_prompt_length=40", "data.image_min_pixels=12544"],
        {},
        "(16 of them image tokens) > the limit of 40",
    ),
    (
        "image-no-processor",
        ["run", B, "model.path=models/vlm-noproc", IMAGES % "img-good"],
        {},
        "has no image processor",
    ),
    ("image-text-model", ["run", B, IMAGES % "img-good"], {}, "is a qwen2 model, not a vision-language one"),
    (
        "image-vllm-no-video-pad",
        ["run", B, "model.path=models/vlm-novideo", IMAGES % "img-good", "rollout.backend=vllm"],
        {},
        "tokenizer has no <|video_pad|> token, which vLLM's Qwen2-VL processor needs",
    ),
    (
        "image-megatron-tp-over-heads",
        ["run", B, VLM, IMAGES % "img-good", "actor.backend=megatron", "actor.num_workers=8"]
        + ["actor.tensor_model_parallel_size=8"],
        {},
        "actor.tensor_model_parallel_size=8 must divide the model's attention heads (4)",
    ),
    (
        "image-multi-turn",
        [
            "run",
            B,
            VLM,
            IMAGES % "img-good",
            "rollout.multi_turn={enabled: true, environment: {tools: [{name: calculator}]}, "
            "template_not_prefix_preserving: new_row}",
            "data.apply_chat_template=true",
            "data.chat_template='{% for m in messages %}{{ m.content }}{% endfor %}'",
        ],
        {},
        "rollout.multi_turn.enabled: multi-turn rollouts with images are not built yet",
    ),
    # ... a config path that is a directory, output files that cannot be written, an unknown time zone
    ("config-is-dir", ["run", "foreign"], {}, "foreign: is a directory, expected a YAML file"),
    ("show-config-is-dir", ["config", "show", "models"], {}, "models: is a directory, expected a YAML file"),
    (
        "profile-stage-unknown",
        ["run", B, "trainer.profile={steps: [1], stages: [update_actr]}"],
        {},
        "trainer.profile.stages",
    ),
    ("profile-step-zero", ["run", B, "trainer.profile={steps: [0]}"], {}, "trainer.profile.steps"),
    (
        "profile-step-beyond-the-run",
        ["run", B, "trainer.profile={steps: [99]}"],
        {},
        "trainer.profile.steps: [99] beyond trainer.total_steps=2",
    ),
    ("plan-gpu-unknown", ["plan", B, "--gpu", "B300"], {}, "--gpu B300: expected one of H20, H100, H200, A100-80G"),
    (
        "compare-png-under-file",
        ["compare", "rlstages-tiny", "--tracking-uri", TRACKING, "--png", "a-file/curves.png"],
        {},
        "--png a-file/curves.png: its directory a-file is not a directory",
    ),
    (
        "compare-png-no-dir",
        ["compare", "rlstages-tiny", "--tracking-uri", TRACKING, "--png", "plots/curves.png"],
        {},
        "its directory plots does not exist",
    ),
    (
        "compare-html-is-dir",
        ["compare", "--tracking-uri", TRACKING, "--html", "foreign"],
        {},
        "foreign: is a directory",
    ),
    (
        "deploy-timezone",
        ["deploy", B, "--cron", "0 2 * * *", "--timezone", "Mars/Olympus"],
        {},
        "--timezone 'Mars/Olympus': not an IANA time zone",
    ),
    ("deploy-timezone-case", ["deploy", B, "--interval", "60", "--timezone", "europe/paris"], {}, "--timezone"),
    # `config show` runs the same pre-flight as `run` (every `run` case is also tried with it below)
    ("show-reward-unknown", ["config", "show", B, "reward.functions=[{name: nope}]"], {}, "unknown reward function"),
    ("show-lora-target", ["config", "show", B, LORA % "nope_proj"], {}, "model.lora.target_modules"),
    # deployments import only their allow-list
    (
        "deploy-not-allowed",
        ["deploy", B, "reward.functions=[{name: 'json:dumps'}]", "--allow-import", "my_rewards"],
        {},
        "module 'json' is not on this deployment's import allow-list",
    ),
]


@pytest.fixture(scope="module")
def cli():
    from rlstages.flows.cli.main import app

    return app


@pytest.mark.parametrize(("case", "argv", "env", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_in_one_line_and_changes_nothing(
    case: str, argv: list[str], env: dict[str, str], needle: str, workspace: Path, cli, tiny_model_dir: Path
) -> None:
    argv = [str(tiny_model_dir) if a == "MODEL" else a for a in argv]
    before = snapshot(workspace)
    old = Path.cwd()
    os.chdir(workspace)
    try:
        result = CliRunner().invoke(cli, argv, env={"RLSTAGES_FAULTS": "", "COLUMNS": "2000", **env})
    finally:
        os.chdir(old)
        os.environ.pop("RLSTAGES_ALLOWED_IMPORTS", None)  # `deploy` sets it for its serve process
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert " object at 0x" not in lines[0]  # names the file, cell or field, not an object's address
    assert snapshot(workspace) == before  # nothing created, replaced or removed (run dirs, MLflow DB included)
    assert not {"mlruns", "mlartifacts", "plots"} & {p.name for p in workspace.iterdir()}


RUN_CASES = [c for c in CASES if c[1][0] == "run"]


@pytest.mark.parametrize(("case", "argv", "env", "needle"), RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_config_show_refuses_what_run_refuses(
    case: str, argv: list[str], env: dict[str, str], needle: str, workspace: Path, cli
) -> None:
    """The rule, for every input `run` refuses: `config show` says the same line (the same pre-flight)."""
    before = snapshot(workspace)
    old = Path.cwd()
    os.chdir(workspace)
    try:
        argv = ["config", "show", *argv[1:]]
        result = CliRunner().invoke(cli, argv, env={"RLSTAGES_FAULTS": "", "COLUMNS": "2000", **env})
    finally:
        os.chdir(old)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], result.stderr
    assert result.stdout == ""  # no config printed for a config that cannot run
    assert snapshot(workspace) == before


def test_a_run_that_committed_nothing_does_not_block_its_name(workspace: Path, cli) -> None:
    """runs/failed holds another config's start that failed before its first step: the pre-flight lets a
    corrected config start over there (a warning says so) and changes nothing itself."""
    before = snapshot(workspace)
    old = Path.cwd()
    os.chdir(workspace)
    try:
        result = CliRunner().invoke(cli, ["config", "show", B, "trainer.run_name=failed"], env={"RLSTAGES_FAULTS": ""})
        done = CliRunner().invoke(cli, ["config", "show", B, "trainer.run_name=done", "rollout.n=8"])
    finally:
        os.chdir(old)
    assert result.exit_code == 0, result.stderr
    assert "runs/failed holds a run that committed nothing" in result.stderr and "run_name: failed" in result.stdout
    assert done.exit_code == 2 and "holds a run of another config" in done.stderr  # one with checkpoints: kept
    assert snapshot(workspace) == before


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
    assert len(RUN_CASES) >= 40


def test_the_finished_mlflow_run_stays_finished(workspace: Path) -> None:
    from mlflow import MlflowClient

    state = json.loads((workspace / "runs" / "done" / "run_state.json").read_text())
    run = MlflowClient(tracking_uri=f"sqlite:///{workspace / 'mlflow.db'}").get_run(state["mlflow_run_id"])
    assert run.info.status == "FINISHED"


def test_megatron_context_parallel_with_images_is_refused(workspace: Path, cli, monkeypatch) -> None:
    """Where Transformer Engine is installed (a GPU machine) megatron's context parallelism passes the config checks;
    with images it is still refused in one line, nothing created (TE's presence faked: the checks only look it up)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine" else real(name, *a)
    )
    argv = ["run", B, VLM, IMAGES % "img-good", "actor.backend=megatron", "actor.num_workers=2"]
    before = snapshot(workspace)
    old = Path.cwd()
    os.chdir(workspace)
    try:
        result = CliRunner().invoke(cli, [*argv, "actor.context_parallel_size=2"], env={"RLSTAGES_FAULTS": ""})
    finally:
        os.chdir(old)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert "actor.context_parallel_size=2: the megatron backend does not split an image batch's sequence" in lines[0]
    assert snapshot(workspace) == before
