"""The working directory of the bad-input table (tests/flows/test_bad_inputs.py): a finished run (MLflow FINISHED),
damaged runs, bad models, data and image files; `snapshot` proves a refused command changed none of it; the names
the table's rows use (`B`, `VLM`, `IMAGES`, ...)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

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


def build_workspace(work: Path, tiny_model_dir: Path, tiny_vlm_dir: Path) -> None:
    """Fill `work`, the current directory: a finished run (MLflow FINISHED), damaged runs, bad models and data
    files."""
    import yaml

    from rlstages.configs import config_hash, load_config, to_yaml
    from rlstages.configs.loader import flatten
    from rlstages.tasks.driver.tracking import client

    base = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    base["model"].update(path=str(tiny_model_dir), provider="local")
    base["tracking"].update(tracking_uri=TRACKING, log_model=False)
    (work / "base.yaml").write_text(yaml.safe_dump(base))
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
