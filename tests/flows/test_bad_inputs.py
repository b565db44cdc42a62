"""Bad input at the command line, table-driven: every case exits 2 with one line naming the field or file, and
leaves every pre-existing file (run directories, checkpoints, the MLflow database and its FINISHED run)
byte-for-byte as it was, with no new run directory, MLflow store or artifact folder. The commands run
in-process (typer's CliRunner); all of them fail in the pre-flight, before a run directory, Ray, Prefect or
MLflow starts. What a run would find out late is rehearsed there (LoRA targets on a meta-device model, the
tracking store, the GPUs and CPUs of a local cluster, local data paths), and `config show` refuses every
input that `run` refuses (the same pre-flight)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
TRACKING = "sqlite:///mlflow.db"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under `root` with its content digest (directories as 'dir')."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel.startswith(".prefect"):
            continue
        out[rel] = "dir" if path.is_dir() else _sha(path)
    return out


def fake_checkpoint(run: Path, step: int, config_hash: str) -> Path:
    """A committed checkpoint in the on-disk format of rlstages.tasks.driver.checkpoints (files, then a manifest)."""
    path = run / "checkpoints" / f"step_{step:06d}"
    (path / "actor").mkdir(parents=True)
    (path / "actor" / "model.safetensors").write_bytes(b"weights of step %d" % step)
    state = {"data_cursor": 4 * step, "kl_state": {}, "mlflow_run_id": None, "config_hash": config_hash}
    (path / "driver_state.json").write_text(json.dumps({**state, "step": step}))
    files = {str(p.relative_to(path)): _sha(p) for p in sorted(path.rglob("*")) if p.is_file()}
    (path / "manifest.json").write_text(json.dumps({"step": step, "created": 0.0, "files": files, **state}))
    return path


def jsonl_config(path: Path, **source: str) -> str:
    """Overrides that switch the base config to a JSONL data source."""
    items = ", ".join(f"{k}: {v}" for k, v in {"kind": "jsonl", "train_path": str(path), **source}.items())
    return "data.source={" + items + "}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_vlm_dir: Path) -> Iterator[Path]:
    """A working directory holding a finished run (MLflow FINISHED), damaged runs, bad models and data files."""
    import yaml

    from rlstages.configs import config_hash, load_config, to_yaml
    from rlstages.configs.loader import flatten
    from rlstages.tasks.driver.tracking import client

    work = tmp_path_factory.mktemp("bad-inputs")
    base = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    base["model"].update(path=str(tiny_model_dir), provider="local")
    base["tracking"].update(tracking_uri=TRACKING, log_model=False)
    (work / "base.yaml").write_text(yaml.safe_dump(base))
    old = Path.cwd()
    os.chdir(work)
    try:
        cfg = load_config(work / "base.yaml", ["trainer.run_name=done"])
        digest = config_hash(cfg)
        c = client(cfg)
        exp = c.create_experiment(cfg.tracking.experiment)
        finished = c.create_run(exp, run_name="done")
        for key, value in list(flatten(cfg.model_dump(mode="json")).items())[:90]:
            c.log_param(finished.info.run_id, key, value[:6000])
        c.set_terminated(finished.info.run_id, "FINISHED")
        for name in ("done", "corrupt", "badmanifest", "badstate", "empty", "uncommitted"):
            run = work / "runs" / name
            run.mkdir(parents=True)
            state = {"config_hash": digest, "mlflow_run_id": finished.info.run_id, "status": "FINISHED"}
            (run / "run_state.json").write_text(json.dumps(state))
            (run / "config.yaml").write_text(to_yaml(load_config(work / "base.yaml", [f"trainer.run_name={name}"])))
            if name != "empty":
                fake_checkpoint(run, 1, digest)
                fake_checkpoint(run, 2, digest)
        (work / "runs/corrupt/checkpoints/step_000002/actor/model.safetensors").write_bytes(b"bit rot")
        (work / "runs/badmanifest/checkpoints/step_000002/manifest.json").write_text("{not json")
        (work / "runs/badstate/run_state.json").write_text("{oops")
        (work / "runs/uncommitted/checkpoints/step_000002/manifest.json").unlink()
        fake_checkpoint(work / "other", 3, "0123456789ab")
        _bad_models(work, tiny_model_dir)
        _bad_data(work)
        _bad_images(work, tiny_vlm_dir)
        (work / "foreign").mkdir()
        (work / "foreign" / "notes.txt").write_text("mine")
        (work / "a-file").write_text("not a directory")
        (work / ".rlstages").mkdir()
        (work / ".rlstages" / "servers.json").write_text('{"prefect": {"pid": "x"')
        (work / "mlruns-file").write_text("x")
        _failed_start(work)
        yield work
    finally:
        os.chdir(old)


def _failed_start(work: Path) -> None:
    """runs/failed: a run of another config that failed at its first stage (nothing committed)."""
    from rlstages.configs import config_hash, load_config, to_yaml

    cfg = load_config(work / "base.yaml", ["trainer.run_name=failed", "rollout.n=8"])
    run = work / "runs" / "failed"
    (run / "steps" / "000001").mkdir(parents=True)
    (run / "steps" / "000001" / "rollout.safetensors").write_bytes(b"a batch of the other config")
    (run / ".faults").mkdir()
    (run / ".faults" / "generate@1-fatal").touch()
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "run_state.json").write_text(json.dumps({"config_hash": config_hash(cfg), "status": "FAILED"}))


def _bad_models(work: Path, good: Path) -> None:
    def copy(name: str) -> Path:
        dest = work / "models" / name
        shutil.copytree(good, dest)
        return dest

    (copy("no-config") / "config.json").unlink()
    (copy("bad-json") / "config.json").write_text("{nope")
    (copy("list-json") / "config.json").write_text("[1, 2]")
    for f in copy("no-weights").glob("*.safetensors"):
        f.unlink()
    weights = next(copy("truncated").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    next(copy("garbage").glob("*.safetensors")).write_bytes(b"\xff" * 64)
    (copy("bad-index") / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )
    (work / "models" / "a-file.bin").write_text("x")


def _bad_data(work: Path) -> None:
    data = work / "data"
    data.mkdir()
    (data / "good.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (data / "empty.jsonl").write_text("\n\n")
    (data / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    (data / "broken.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": \n')
    (data / "noanswer.jsonl").write_text('{"prompt": "1+1?"}\n')
    (data / "list.jsonl").write_text("[1, 2]\n")
    (data / "long.jsonl").write_text(json.dumps({"prompt": "7 " * 700, "answer": "7"}) + "\n")
    (work / "latin1.yaml").write_bytes("# caf\xe9\nmodel: {}\n".encode("latin-1"))
    (work / "broken.yaml").write_text("model: [unclosed\n")
    (work / "list.yaml").write_text("- a\n- b\n")


def _bad_images(work: Path, vlm: Path) -> None:
    """Image rows (verl's schema, JSONL with image paths) and a tiny Qwen2-VL, with and without its processor."""
    from PIL import Image

    shutil.copytree(vlm, work / "models" / "vlm")
    shutil.copytree(vlm, work / "models" / "vlm-noproc")
    (work / "models" / "vlm-noproc" / "preprocessor_config.json").unlink()
    _without_video_pad(vlm, work / "models" / "vlm-novideo")
    data = work / "data"
    Image.new("RGB", (56, 56), (255, 0, 0)).save(data / "red.png")
    (data / "broken.png").write_bytes(b"\x89PNG not really")

    def rows(name: str, prompt: str, images: list[str]) -> None:
        row = {"prompt": prompt, "images": [{"bytes": None, "path": f"data/{i}"} for i in images]}
        (data / name).write_text(json.dumps({**row, "reward_model": {"ground_truth": "red"}}) + "\n")

    rows("img-good.jsonl", "<image>What colour is the square?", ["red.png"])
    rows("img-broken.jsonl", "<image>What colour?", ["broken.png"])
    rows("img-missing.jsonl", "<image>What colour?", ["nowhere.png"])
    rows("img-count.jsonl", "<image> and <image>: what colours?", ["red.png"])
    rows("img-many.jsonl", "<image>" * 5 + "What colours?", ["red.png"] * 5)
    Image.new("RGB", (56, 56), (0, 0, 255)).save(work.parent / f"{work.name}-outside.png")  # opens: only refused
    row = {"prompt": "<image>What colour?", "images": [{"bytes": None, "path": f"../{work.name}-outside.png"}]}
    (data / "img-climbs.jsonl").write_text(json.dumps({**row, "reward_model": {"ground_truth": "blue"}}) + "\n")
    (data / "verl").mkdir()  # apart: `datasets-glob` needs data/*.parquet to match nothing
    _verl_parquet(data / "verl" / "img.parquet", (data / "red.png").read_bytes())
    _verl_parquet(data / "verl" / "img-bad.parquet", b"not an image at all")


def _verl_parquet(path: Path, image: bytes) -> None:
    """verl's image schema: chat messages with `<image>`, the images' bytes in the cells, the answer in reward_model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {
        "data_source": "colors",
        "prompt": [{"role": "user", "content": "<image>What colour is the square?"}],
        "images": [{"bytes": image, "path": None}],
        "reward_model": {"style": "rule", "ground_truth": "red"},
    }
    pq.write_table(pa.Table.from_pylist([row, row]), path)


def _without_video_pad(vlm: Path, out: Path) -> None:
    """A copy of the tiny Qwen2-VL whose tokenizer lacks `<|video_pad|>` (as smollm2-vl models built before
    2026-11-27): the token taken out of the tokenizer's added tokens and special-token list."""
    shutil.copytree(vlm, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<|video_pad|>"]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if isinstance(config.get(key), list):
            config[key] = [t for t in config[key] if t != "<|video_pad|>"]
    decoder = config.get("added_tokens_decoder", {})
    config["added_tokens_decoder"] = {k: v for k, v in decoder.items() if v.get("content") != "<|video_pad|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


B = "base.yaml"
M = "models"
D = "data"
LORA = "model.lora={rank: 4, target_modules: [q_proj, %s]}"
VLM = "model.path=models/vlm"
IMAGES = "data.source={kind: datasets, path: data/%s.jsonl}"
PARQUET = "data.source={kind: datasets, path: data/verl/img.parquet}"
LOCAL_RAY = {"RAY_ADDRESS": ""}  # the run's Ray starts here (or is the one this test process joined)

# (case id, argv, environment, text the one line must contain)
CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    # the config file and its overrides
    ("missing-config", ["run", "nope.yaml"], {}, "nope.yaml: no such config file"),
    ("non-utf8-config", ["run", "latin1.yaml"], {}, "latin1.yaml: not UTF-8"),
    ("broken-yaml", ["run", "broken.yaml"], {}, "broken.yaml: line"),
    ("yaml-list", ["run", "list.yaml"], {}, "expected a mapping"),
    ("override-no-equals", ["run", B, "rollout.n"], {}, "expected KEY=VALUE"),
    ("override-double-dot", ["run", B, "trainer..run_name=x"], {}, "empty segment"),
    ("override-trailing-dot", ["run", B, "rollout.n.=4"], {}, "empty segment"),
    ("override-empty-key", ["run", B, "=4"], {}, "empty key"),
    ("unknown-key", ["run", B, "trainer.colour=red"], {}, "trainer.colour: unknown key"),
    ("wrong-type", ["run", B, "rollout.n=one"], {}, "rollout.n: Input should be a valid integer"),
    ("zero-steps", ["run", B, "trainer.total_steps=0"], {}, "trainer.total_steps"),
    ("grpo-n1", ["run", B, "rollout.n=1"], {}, "needs rollout.n > 1"),
    ("gae-no-critic", ["run", B, "algorithm.adv_estimator=gae"], {}, "add a `critic:` section"),
    # what the chosen backend can do (its registry entry)
    ("torch-two-ranks", ["run", B, "actor.num_workers=2"], {}, "actor.backend=torch trains in one process"),
    ("sglang-no-gpus", ["run", B, "rollout.backend=sglang"], {}, "rollout.backend=sglang needs GPUs"),
    (
        "lora-on-deepspeed",
        ["run", B, LORA % "v_proj", "actor.backend=deepspeed"],
        {},
        "model.lora trains adapters on the torch backend only; got actor.backend=deepspeed",
    ),
    (
        "megatron-cp-without-te",
        ["run", B, "actor.backend=megatron", "actor.num_workers=2", "actor.context_parallel_size=2"],
        {},
        "actor.context_parallel_size=2: megatron-core splits attention over CP ranks only with Transformer Engine",
    ),
    (
        "megatron-ep-dense-model",
        ["run", B, "actor.backend=megatron", "actor.num_workers=2", "actor.expert_model_parallel_size=2"],
        {},
        "actor.expert_model_parallel_size=2: the model is dense",
    ),
    (
        "megatron-etp-over-tp",
        ["run", B, "actor.backend=megatron", "actor.num_workers=2", "actor.expert_tensor_parallel_size=2"],
        {},
        "expert_tensor_parallel_size=2 must divide tensor_model_parallel_size=1",
    ),
    (
        "megatron-router-topk-over-experts",
        ["run", B, "actor.backend=megatron", "model.provider=tiny-random"]
        + ["model.tiny={model_type: qwen3_moe, num_experts: 4}", "actor.moe={router_topk: 8}"],
        {},
        "actor.moe.router_topk=8 is larger than the model's 4 routed experts; use at most 4",
    ),
    (
        "expert-parallel-on-torch",
        ["run", B, "actor.expert_model_parallel_size=2"],
        {},
        "actor.expert_model_parallel_size: expert parallelism needs actor.backend=megatron",
    ),
    (
        "tensor-parallel-on-deepspeed",
        ["run", B, "actor.backend=deepspeed", "actor.tensor_model_parallel_size=2"],
        {},
        "actor.tensor_model_parallel_size: tensor parallelism needs actor.backend=megatron",
    ),
    ("async-field-without-mode", ["run", B, "trainer.async.max_staleness=2"], {}, "set trainer.mode: async"),
    (
        "async-on-hybrid-engine",
        ["run", B, "trainer.mode=async", "cluster.hybrid_engine=true"],
        {},
        "trainer.mode=async overlaps generation with the update",
    ),
    (
        "async-kv-keep-without-partial",
        ["run", B, "trainer.mode=async", "cluster.hybrid_engine=false", "trainer.async.kv_on_update=keep"],
        {},
        "trainer.async.kv_on_update=keep only matters with partial_rollout: true",
    ),
    (
        "async-kv-keep-on-vllm",
        [
            "run",
            B,
            "trainer.mode=async",
            "cluster.hybrid_engine=false",
            "trainer.async.partial_rollout=true",
            "trainer.async.kv_on_update=keep",
            "rollout.backend=vllm",
        ],
        {},
        "trainer.async.kv_on_update=keep: rollout.backend=vllm continues an interrupted sequence by prefilling",
    ),  # fmt: skip
    (
        "async-queue-below-a-step",
        ["run", B, "trainer.mode=async", "cluster.hybrid_engine=false", "trainer.async.queue_capacity=1"],
        {},
        "trainer.async.queue_capacity=1 is smaller than one step's",
    ),
    ("micro-batch", ["run", B, "actor.micro_batch_size=5"], {}, "actor.micro_batch_size=5 must divide"),
    ("resume-mode", ["run", B, "checkpoint.resume=sometimes"], {}, "checkpoint.resume"),
    ("on-corrupt", ["run", B, "checkpoint.on_corrupt=maybe"], {}, "checkpoint.on_corrupt"),
    ("on-nonfinite", ["run", B, "trainer.on_nonfinite=ignore"], {}, "trainer.on_nonfinite"),
    ("overlong-policy", ["run", B, "data.overlong_prompts=cut"], {}, "data.overlong_prompts"),
    ("no-rewards", ["run", B, "reward.functions=[]"], {}, "reward.functions"),
    ("sglang-on-cpu", ["run", B, "rollout.backend=sglang"], {}, "rollout.backend=sglang needs GPUs"),
    (
        "python-tool-not-isolable",  # bubblewrap asked for, and not on PATH: refused, not run weaker
        [
            "run",
            B,
            "rollout.multi_turn={enabled: true, environment: {tools: [{name: python, kwargs: "
            "{isolation_backend: bwrap}}]}}",
        ],
        {"PATH": "/nonexistent"},
        "rollout.multi_turn.environment.tools.0.kwargs.require_isolation: this machine cannot isolate the python "
        "tool: bwrap not found",
    ),
    # run names (schema: `config show` refuses them too)
    ("name-dotdot", ["run", B, "trainer.run_name=.."], {}, "trainer.run_name: '..' is not a run name"),
    ("name-dot", ["run", B, "trainer.run_name=a.b"], {}, "trainer.run_name: 'a.b' is not a run name"),
    ("name-slash", ["run", B, "trainer.run_name=a/b"], {}, "trainer.run_name: 'a/b' is not a run name"),
    ("name-up", ["run", B, "trainer.run_name=../done"], {}, "trainer.run_name"),
    ("name-empty", ["run", B, "trainer.run_name="], {}, "trainer.run_name: '' is not a run name"),
    ("name-space", ["run", B, "trainer.run_name=a b"], {}, "trainer.run_name"),
    ("name-long", ["run", B, "trainer.run_name=" + "x" * 101], {}, "trainer.run_name"),
    ("show-name-dotdot", ["config", "show", B, "trainer.run_name=.."], {}, "trainer.run_name"),
    ("show-name-empty", ["config", "show", B, "trainer.run_name="], {}, "trainer.run_name"),
    # the model directory
    ("model-missing", ["run", B, "model.path=models/none"], {}, "model.path: models/none does not exist"),
    ("model-is-file", ["run", B, "model.path=models/a-file.bin"], {}, "a-file.bin is not a directory"),
    ("model-no-config", ["run", B, f"model.path={M}/no-config"], {}, "no-config/config.json is missing"),
    ("model-bad-json", ["run", B, f"model.path={M}/bad-json"], {}, "bad-json/config.json is not valid JSON"),
    ("model-list-json", ["run", B, f"model.path={M}/list-json"], {}, "list-json/config.json is not an HF config"),
    ("model-no-weights", ["run", B, f"model.path={M}/no-weights"], {}, "no-weights has no *.safetensors"),
    ("model-truncated", ["run", B, f"model.path={M}/truncated"], {}, "is truncated"),
    ("model-garbage", ["run", B, f"model.path={M}/garbage"], {}, "is not a readable safetensors file"),
    ("model-index", ["run", B, f"model.path={M}/bad-index"], {}, "model-00002-of-00002.safetensors is named"),
    ("reward-model", ["run", B, "reward.reward_model={path: models/none}"], {}, "reward.reward_model.path"),
    # data files
    ("data-missing", ["run", B, jsonl_config(Path("data/none.jsonl"))], {}, "data.source.train_path"),
    ("data-empty", ["run", B, jsonl_config(Path("data/empty.jsonl"))], {}, "empty.jsonl has no rows"),
    ("data-latin1", ["run", B, jsonl_config(Path("data/latin1.jsonl"))], {}, "latin1.jsonl is not UTF-8"),
    ("data-broken", ["run", B, jsonl_config(Path("data/broken.jsonl"))], {}, "broken.jsonl:2 is not JSON"),
    ("data-no-answer", ["run", B, jsonl_config(Path("data/noanswer.jsonl"))], {}, "noanswer.jsonl:1 lacks 'answer'"),
    ("data-not-object", ["run", B, jsonl_config(Path("data/list.jsonl"))], {}, "list.jsonl:1 lacks"),
    ("data-key", ["run", B, jsonl_config(Path("data/good.jsonl"), prompt_key="question")], {}, "lacks 'question'"),
    (
        "data-eval-missing",
        ["run", B, jsonl_config(Path("data/good.jsonl"), eval_path="data/none.jsonl")],
        {},
        "data.source.eval_path",
    ),
    ("prompt-too-long", ["run", B, jsonl_config(Path("data/long.jsonl"))], {}, "prompt(s) longer than 504 tokens"),
    ("no-room", ["run", B, "rollout.max_new_tokens=600"], {}, "rollout.max_new_tokens: 600 leaves no room"),
    # code the config names
    ("reward-unknown", ["run", B, "reward.functions=[{name: nope}]"], {}, "unknown reward function 'nope'"),
    ("reward-module", ["run", B, "reward.functions=[{name: 'no_such_mod:f'}]"], {}, "cannot import module"),
    ("reward-attr", ["run", B, "reward.functions=[{name: 'json:nope'}]"], {}, "has no attribute 'nope'"),
    ("reward-not-callable", ["run", B, "reward.functions=[{name: 'os:sep'}]"], {}, "is not callable"),
    ("reward-malformed", ["run", B, "reward.functions=[{name: ':f'}]"], {}, "expected 'package.module:function'"),
    ("plugin-missing", ["run", B, "model.plugins=[no_such_plugin]"], {}, "model.plugins.0"),
    # fault injection spec
    ("faults-garbage", ["run", B], {"RLSTAGES_FAULTS": "garbage"}, "RLSTAGES_FAULTS: 'garbage'"),
    ("faults-step", ["run", B], {"RLSTAGES_FAULTS": "generate@x:fatal"}, "RLSTAGES_FAULTS"),
    ("faults-stage", ["run", B], {"RLSTAGES_FAULTS": "nostage@1:fatal"}, "unknown stage 'nostage'"),
    ("faults-kind", ["run", B], {"RLSTAGES_FAULTS": "generate@1:explode"}, "unknown kind 'explode'"),
    # existing runs: never overwritten by another config, damaged ones said loudly
    ("other-config", ["run", B, "trainer.run_name=done", "rollout.n=8"], {}, "holds a run of another config"),
    ("other-actor-backend", ["run", B, "trainer.run_name=done", "actor.backend=megatron"], {}, "another config"),
    ("other-rollout-backend", ["run", B, "trainer.run_name=done", "rollout.backend=vllm"], {}, "another config"),
    ("resume-never", ["run", B, "trainer.run_name=done", "checkpoint.resume=never"], {}, "already holds a run"),
    ("output-is-file", ["run", B, "trainer.output_dir=a-file"], {}, "trainer.output_dir: a-file exists"),
    ("run-corrupt", ["run", B, "trainer.run_name=corrupt"], {}, "actor/model.safetensors does not match its sha256"),
    ("resume-not-a-run", ["resume", "foreign"], {}, "foreign: not a run directory"),
    ("resume-corrupt", ["resume", "runs/corrupt"], {}, "step_000002: actor/model.safetensors does not match"),
    ("resume-bad-manifest", ["resume", "runs/badmanifest"], {}, "step_000002: manifest.json is unreadable"),
    ("resume-bad-state", ["resume", "runs/badstate"], {}, "run_state.json: damaged run-state file"),
    ("eval-not-a-run", ["eval", "foreign"], {}, "foreign: not a run directory"),
    ("eval-corrupt", ["eval", "runs/corrupt"], {}, "does not match its sha256"),
    ("eval-no-checkpoint", ["eval", "runs/empty"], {}, "runs/empty: no committed checkpoint"),
    ("eval-ckpt-missing", ["eval", "runs/done", "--checkpoint", "runs/done/nope"], {}, "nope: no such directory"),
    (
        "eval-ckpt-uncommitted",
        ["eval", "runs/uncommitted", "--checkpoint", "runs/uncommitted/checkpoints/step_000002"],
        {},
        "no manifest.json; not a committed checkpoint",
    ),
    (
        "eval-ckpt-corrupt",
        ["eval", "runs/done", "--checkpoint", "runs/corrupt/checkpoints/step_000002"],
        {},
        "does not match its sha256",
    ),
    (
        "eval-ckpt-other-config",
        ["eval", "runs/done", "--checkpoint", "other/checkpoints/step_000003"],
        {},
        "a checkpoint of another config",
    ),
    # conversion
    ("convert-missing", ["convert", "models/none", "out"], {}, "models/none: HF model directory not found"),
    ("convert-markup", ["convert", "a[/]b", "out"], {}, "a[/]b: HF model directory not found"),
    (
        "convert-into-checkpoint",
        ["convert", "MODEL", "runs/done/checkpoints/step_000002"],
        {},
        "step_000002: exists and is not an rlstages conversion output",
    ),
    ("convert-into-foreign", ["convert", "MODEL", "foreign"], {}, "foreign: exists and is not an rlstages conversion"),
    ("convert-into-file", ["convert", "MODEL", "a-file"], {}, "a-file: exists and is not a directory"),
    (
        "convert-uneven-stages",
        ["convert", "MODEL", "out", "--pp", "2", "--first-stage-layers", "5"],
        {},
        "uneven pipeline stages: 2 layers minus first=5",
    ),
    ("export-not-converted", ["export", "foreign", "out"], {}, "foreign is not a complete conversion output"),
    # servers and comparisons
    ("server-status-broken", ["server", "status"], {}, "servers.json: damaged server state file"),
    ("server-down-broken", ["server", "down"], {}, "servers.json: damaged server state file"),
    ("compare-no-db", ["compare", "--tracking-uri", "sqlite:///nope.db"], {}, "no such database file nope.db"),
    ("compare-no-store", ["compare", "--tracking-uri", "missing-store"], {}, "no such MLflow store directory"),
    ("compare-store-file", ["compare", "--tracking-uri", "mlruns-file"], {}, "no such MLflow store directory"),
    ("compare-experiment", ["compare", "nope", "--tracking-uri", TRACKING], {}, "no experiment 'nope'"),
    (
        "compare-metric",
        ["compare", "rlstages-tiny", "--tracking-uri", TRACKING, "--metric", "reward/nope"],
        {},
        "--metric 'reward/nope'",
    ),
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
