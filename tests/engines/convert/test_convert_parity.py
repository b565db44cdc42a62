"""Parity gate: a megatron-core GPTModel loaded from the converted checkpoint gives the HF model's logits.

Every template (and bias / MHA / tied variants) at TP=1 and TP=2, a pipeline with virtual stages (even, and
megatron-core's uneven first stage), and the dist_checkpointing copy (saved at TP=1) loaded under TP=2:
max |logits diff| <= 1e-5 in fp32 and argmax equal.
Run: .venv/bin/python -m pytest tests/engines/convert/test_convert_parity.py -q
Hardware: CPU; megatron-core installed (skipped otherwise); up to 2 local gloo processes; ~1 min on 2 cores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from convert_fixtures import make_hf_model

from rlstages.engines.convert import convert_hf_to_mcore
from rlstages.engines.megatron.dist_ckpt import dist_checkpoint_writer
from rlstages.engines.megatron.parity import verify_parity_many

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")

VARIANTS = {
    "llama": {},
    "llama-mha-bias": {"model_type": "llama", "heads": 4, "kv_heads": 4, "attention_bias": True, "mlp_bias": True},
    "qwen2": {},
    "qwen2-tied": {"model_type": "qwen2", "tie": True},
    "qwen3": {},
    "mistral": {},
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity-hf")
    out = {}
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        out[name] = make_hf_model(root / name, kw.pop("model_type", name), **kw)
    return out


@pytest.fixture(scope="module")
def dist_ckpt_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model converted at TP=1 with its megatron-core dist_checkpointing copy (saved by one worker)."""
    root = tmp_path_factory.mktemp("dist")
    hf = make_hf_model(root / "hf", "llama", vocab=100)
    mcore = convert_hf_to_mcore(hf, root / "m", tp=1, extra_outputs=dist_checkpoint_writer())
    assert (mcore / "dist_ckpt" / "metadata.json").is_file()
    return mcore, hf


@pytest.mark.parametrize("tp", [1, 2])
def test_parity_every_template(hf_models: dict[str, Path], dist_ckpt_case, tmp_path: Path, tp: int) -> None:
    cases: list[tuple] = [(convert_hf_to_mcore(hf, tmp_path / name, tp=tp), hf) for name, hf in hf_models.items()]
    n = len(cases)
    # the gate can fail: the qwen2 checkpoint against another random qwen2
    cases.append((cases[2][0], make_hf_model(tmp_path / "other", "qwen2", seed=1)))
    if tp == 2:  # the dist checkpoint saved at TP=1, resharded by megatron-core on load
        cases.append((*dist_ckpt_case, "dist_ckpt"))
    else:  # no HF directory: the reference model is rebuilt from the checkpoint's own export
        cases.append((cases[3][0], None))
    reports = verify_parity_many(cases, raise_on_fail=False)
    for (path, *_), report in zip(cases[:n], reports, strict=False):
        assert report.tp == tp
        assert report.max_abs_diff <= 1e-5, (path.name, report)
        assert report.argmax_agreement == 1.0, (path.name, report)
    assert not reports[n].passed and reports[n].max_abs_diff > 1e-3
    assert reports[n + 1].passed


def test_parity_pipeline_with_virtual_stages(tmp_path: Path) -> None:
    cases = []
    for tie in (False, True):
        hf = make_hf_model(tmp_path / f"hf{tie}", "qwen2", layers=4, tie=tie)
        cases.append((convert_hf_to_mcore(hf, tmp_path / f"m{tie}", pp=2, vpp=2), hf))
    hf = make_hf_model(tmp_path / "hf6", "qwen2", layers=6)  # uneven: stage 0 holds 2 layers, stage 1 holds 4
    cases.append((convert_hf_to_mcore(hf, tmp_path / "uneven", pp=2, vpp=2, first_stage_layers=2), hf))
    for report in verify_parity_many(cases):
        assert report.passed and (report.pp, report.vpp) == (2, 2)
