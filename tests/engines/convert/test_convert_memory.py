"""Streaming: converting a model several shards large never holds the whole model (peak RSS, measured).

Run: .venv/bin/python -m pytest tests/engines/convert/test_convert_memory.py -q   (CPU only, ~10 s, ~0.5 GB RAM)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

MEASURE = """
import json, sys, torch
torch.set_num_threads(1)
from rlstages.engines.convert import convert_hf_to_mcore, convert_mcore_to_hf
from rlstages.engines.convert.spec import _with_hf_defaults
_with_hf_defaults({"model_type": "llama"})  # the one-off cost of importing transformers is not model memory
# nor is torch._dynamo's (~35 MB), which torch imports on the first cat of meta tensors (the shape pass)
torch.cat([torch.empty(2, device="meta")] * 2)
hf, out, direction = sys.argv[1], sys.argv[2], sys.argv[3]
def status_kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
before = status_kb("VmRSS")
if direction == "to_mcore":
    convert_hf_to_mcore(hf, out, tp=2, pp=2, fsync=False)
else:
    convert_mcore_to_hf(hf, out, fsync=False, max_shard_bytes=8_000_000)
print(json.dumps({"before_kb": before, "peak_kb": status_kb("VmHWM")}))
"""


def _peak_delta_mb(src: Path, out: Path, direction: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(src), str(out), direction],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    numbers = json.loads(done.stdout.strip().splitlines()[-1])
    return (numbers["peak_kb"] - numbers["before_kb"]) / 1024


def write_random_llama(out: Path, shard_bytes: int = 8_000_000, **sizes: int) -> Path:
    """A Llama directory of random weights in ~`shard_bytes` shards, without running transformers' init."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **sizes)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    out.mkdir()
    config.save_pretrained(out)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, shape in shapes.items():
        if sum(t.numel() * 4 for t in shards[-1].values()) > shard_bytes:
            shards.append({})
        shards[-1][name] = torch.randn(shape)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_peak_memory_is_about_one_layer_plus_one_shard(tmp_path: Path) -> None:
    hf = write_random_llama(
        tmp_path / "hf", hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, num_hidden_layers=16, vocab_size=8192,
    )  # fmt: skip
    shards = sorted(hf.glob("*.safetensors"))
    model_mb = sum(p.stat().st_size for p in shards) / 2**20
    shard_mb = max(p.stat().st_size for p in shards) / 2**20
    layer_mb = 4 * (256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 1024) / 2**20
    assert len(shards) >= 8 and model_mb > 70
    bound = 2 * shard_mb + 2 * layer_mb + 16  # in-flight tensors, TP copies, allocator slack
    to_mcore = _peak_delta_mb(hf, tmp_path / "mcore", "to_mcore")
    print(f"peak over baseline: to_mcore {to_mcore:.1f} MB, bound {bound:.1f} MB, model {model_mb:.1f} MB")
    assert to_mcore < min(bound, model_mb / 2), (to_mcore, bound, model_mb)
    to_hf = _peak_delta_mb(tmp_path / "mcore", tmp_path / "back", "to_hf")
    print(f"peak over baseline: to_hf {to_hf:.1f} MB")
    assert to_hf < min(bound, model_mb / 2), (to_hf, bound, model_mb)
