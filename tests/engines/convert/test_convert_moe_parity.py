"""MoE parity gate: megatron-core's GPTModel loaded from a converted qwen3_moe / mixtral / deepseek_v3 checkpoint
gives the HF model's logits (scale-aware tolerance, argmax equal), at EP1 TP1 PP1 and at TP2 x PP2 x EP2 with expert
TP 1 (four gloo processes, the allgather token dispatcher) for every type; a dist checkpoint written at EP2 loads at
EP1. (EP2 at TP1: tests/engines/megatron/test_megatron_moe.py, against the torch backend.)

Run: .venv/bin/python -m pytest tests/engines/convert/test_convert_moe_parity.py -q
Hardware: CPU; megatron-core installed (skipped otherwise); up to 4 local gloo processes; ~1-2 min on 2 quiet cores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from moe_fixtures import MOE_TYPES, make_moe_model

from rlstages.engines.convert import convert_hf_to_mcore
from rlstages.engines.megatron.dist_ckpt import dist_checkpoint_writer
from rlstages.engines.megatron.parity import verify_parity_many

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


def test_parity_every_moe_type(tmp_path: Path) -> None:
    cases: list[tuple] = []
    for model_type in MOE_TYPES:
        hf = make_moe_model(tmp_path / model_type, model_type)
        cases.append((convert_hf_to_mcore(hf, tmp_path / f"m-{model_type}"), hf))
    # the gate can fail: the qwen3_moe checkpoint against another random qwen3_moe
    cases.append((cases[0][0], make_moe_model(tmp_path / "other", "qwen3_moe", seed=1)))
    # a dist checkpoint written by 2 EP ranks (experts 2 + 2) loaded into this EP=1 world (resharded)
    ep2 = convert_hf_to_mcore(cases[0][1], tmp_path / "ep2", ep=2, extra_outputs=dist_checkpoint_writer())
    cases.append((ep2, cases[0][1], "dist_ckpt"))
    reports = verify_parity_many(cases, raise_on_fail=False)
    for (path, *_), report in zip(cases[:3] + cases[4:], reports[:3] + reports[4:], strict=True):
        assert report.passed and report.max_abs_diff <= 1e-5, (path.name, report)
        assert report.argmax_agreement == 1.0, (path.name, report)
    assert not reports[3].passed and reports[3].max_abs_diff > 1e-3
    assert reports[4].ep == 1 and (ep2 / "dist_ckpt" / "metadata.json").is_file()


def test_parity_every_moe_type_at_tp2_pp2_ep2(tmp_path: Path) -> None:
    # one 4-process world at TP2 x PP2 x EP2 with expert TP 1 (the presets' ETP): qwen3_moe with softmax-then-top-k
    # routing, mixtral, deepseek_v3 (its dense first layer alone on stage 0; MLA's heads split over TP; experts and
    # the router's score-correction bias over EP)
    hfs = [make_moe_model(tmp_path / "qwen3_moe", "qwen3_moe", norm_topk_prob=False)]
    hfs += [make_moe_model(tmp_path / t, t) for t in MOE_TYPES[1:]]
    cases = [(convert_hf_to_mcore(hf, tmp_path / f"m-{hf.name}", tp=2, pp=2, ep=2, etp=1), hf) for hf in hfs]
    for hf, report in zip(hfs, verify_parity_many(cases, raise_on_fail=False), strict=True):
        assert report.passed and (report.tp, report.pp, report.ep) == (2, 2, 2), (hf.name, report)
        assert report.max_abs_diff <= 1e-5 and report.argmax_agreement == 1.0, (hf.name, report)
