"""Weight sync form: each training rank exports its own shard with `rank_mcore_to_hf` (TP all-gather over gloo).

Run: .venv/bin/python -m pytest tests/engines/convert/test_convert_rank_export.py -q
Hardware: CPU; starts 4 local processes (TP=2 x PP=2) on 127.0.0.1; ~10 s; no megatron-core needed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from convert_fixtures import hf_tensors, make_hf_model
from safetensors.torch import load_file

from rlstages.engines.convert import convert_hf_to_mcore
from rlstages.engines.megatron.gloo_world import run_world


def test_each_rank_exports_its_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases, hf_dirs = [], []
    for tie in (False, True):
        case = tmp_path / f"tie{tie}"
        hf_dirs.append(make_hf_model(case / "hf", "qwen2", tie=tie, layers=2))
        cases.append([str(convert_hf_to_mcore(hf_dirs[-1], case / "mcore", tp=2, pp=2)), str(case)])
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    by_rank = run_world("convert_fixtures:rank_export_worker", 4, {"cases": cases, "tp": 2, "pp": 2})
    for i, (tie, hf) in enumerate(zip((False, True), hf_dirs, strict=True)):
        names = [by_rank[rank][i] for rank in range(4)]
        assert names[0] == names[1] and names[2] == names[3]  # both TP ranks of a stage yield the same tensors
        assert "model.embed_tokens.weight" in names[0] and "model.layers.0.mlp.down_proj.weight" in names[0]
        assert "model.norm.weight" in names[2] and "model.layers.1.mlp.down_proj.weight" in names[2]
        assert ("lm_head.weight" in names[2]) == (not tie)
        exported: dict[str, torch.Tensor] = {}
        for rank in range(4):
            for name, tensor in load_file(Path(cases[i][1]) / f"rank{rank}.safetensors").items():
                assert name not in exported or torch.equal(exported[name], tensor)
                exported[name] = tensor
        expected = hf_tensors(hf)
        assert sorted(exported) == sorted(expected)
        assert all(torch.equal(exported[n], expected[n]) for n in expected)
