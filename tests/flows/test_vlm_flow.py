"""A vision-language model through the whole flow: verl's schema in parquet (chat prompts with `<image>`,
`images` as `{bytes, path}` dicts, `reward_model.ground_truth`, `data_source`), a tiny random Qwen2-VL, two
GRPO steps with Prefect and MLflow (the engines in the driver). The image column's three forms load alike."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rlstages.configs.data import DatasetsDataConfig
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.data.vision import row_images
from tests.flows.flow_support import IN_DRIVER, ROOT, final_weights, mlflow_run, overrides, run_dir, tiny_cfg

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}


def png(colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), COLOURS[colour]).save(buf, format="PNG")
    return buf.getvalue()


def test_image_cells_bytes_paths_and_dicts(tmp_path: Path) -> None:
    (tmp_path / "r.png").write_bytes(png("red"))
    cell = [png("red"), str(tmp_path / "r.png"), {"bytes": None, "path": "r.png"}, {"bytes": png("red"), "path": None}]
    assert row_images(cell, "row 0", "images", base=tmp_path) == (png("red"),) * 4


def test_verl_image_parquet_trains_a_tiny_qwen2_vl(tmp_path: Path, tiny_vlm_dir: Path, prefect_harness) -> None:
    names = list(COLOURS)
    rows = [
        {
            "data_source": "colors",
            "prompt": [{"role": "user", "content": "<image>What colour is the square?"}],
            "images": [{"bytes": png(names[i % 4]), "path": None}],
            "reward_model": {"style": "rule", "ground_truth": names[i % 4]},
            "extra_info": {"index": i},
        }
        for i in range(8)
    ]
    data = tmp_path / "colors.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    cfg = tiny_cfg(
        tmp_path, tiny_vlm_dir, "vlm", IN_DRIVER, f"data.source={{kind: datasets, path: {data}}}",
        "data.prompts_per_step=2", "data.eval_prompts=4", "reward.functions=[{name: digit_ratio}]",
        "actor.micro_batch_size=4", "actor.optim.group_lr={vision_tower: 0.01}",
    )  # fmt: skip
    assert isinstance(cfg.data.source, DatasetsDataConfig)
    rl_post_train(cfg)
    client, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
    before = load_file(str(tiny_vlm_dir / "model.safetensors"))
    after = load_file(str(run_dir(cfg) / "final" / "model.safetensors"))
    moved = [k for k in before if k.startswith("visual.") and not torch.equal(before[k], after[k])]
    assert moved, "the vision tower trained"
    assert (run_dir(cfg) / "final" / "preprocessor_config.json").is_file(), "the export has its image processor"


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_tiny_qwen2_5_vl_trains_on_megatron(tmp_path: Path, prefect_harness) -> None:
    """`model.tiny.model_type: qwen2_5_vl` built by the tiny-random provider, converted (the qwen2_5_vl template) and
    trained by the Megatron-Core backend (`vlm_model.QwenVLModel`) for 2 GRPO steps; the vision tower moves."""
    names = list(COLOURS)
    rows = [
        {"prompt": "<image>What colour is the square?", "images": [{"bytes": png(names[i % 4]), "path": None}],
         "reward_model": {"ground_truth": names[i % 4]}, "data_source": "colors"}
        for i in range(8)
    ]  # fmt: skip
    data = tmp_path / "colors.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    model = tmp_path / "tiny-qwen2_5_vl"
    cfg = tiny_cfg(
        tmp_path, model, "mvlm", IN_DRIVER, "model.provider=tiny-random", "model.tiny.model_type=qwen2_5_vl",
        f"data.source={{kind: datasets, path: {data}}}", "data.prompts_per_step=2", "data.eval_prompts=4",
        "reward.functions=[{name: digit_ratio}]", "actor.backend=megatron", "actor.micro_batch_size=4",
    )  # fmt: skip
    rl_post_train(cfg)
    client, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff")) < 1e-4
    before, after = load_file(str(model / "model.safetensors")), final_weights(cfg)
    assert any(k.startswith("visual.") and not torch.equal(before[k], after[k]) for k in before), "the tower trained"


def test_the_demo_config_passes_the_preflight(tmp_path: Path, tiny_vlm_dir: Path) -> None:
    """configs/vlm_colors.yaml validates and passes the pre-flight (its colour prompts, one image each, within the
    length limit through its chat template) on a Qwen2-VL directory; nothing is created. Its prompt ends in
    "Answer:", so the one token it samples is the answer (docs/vlm.md: the demo)."""
    from rlstages.configs.loader import load_config
    from rlstages.engines.models import load_tokenizer
    from rlstages.engines.rollout.batching import prompt_text
    from rlstages.tasks.driver.data.loading import load_split
    from rlstages.tasks.driver.preflight import preflight

    cfg = load_config(ROOT / "configs" / "vlm_colors.yaml", overrides(tmp_path, tiny_vlm_dir, "demo"))
    assert cfg.actor.freeze == ("language_model",) and cfg.rollout.max_new_tokens == 1
    assert preflight(cfg) == []
    assert not (tmp_path / "runs").exists()
    row = load_split(cfg.data, "eval").rows[0]
    assert len(row.images) == 1 and row.text.endswith("<image>") and row.ground_truth in COLOURS
    tokenizer = load_tokenizer(tiny_vlm_dir)
    tokenizer.chat_template = cfg.data.chat_template
    text, _ = prompt_text(tokenizer, row.prompt("x"), True, cfg.data.system_prompt)
    assert text.startswith("<|im_start|>system\n" + str(cfg.data.system_prompt)) and text.endswith("assistant\nAnswer:")
