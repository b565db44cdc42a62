"""Helpers shared by the conversion tests: tiny random HF models saved as real safetensors directories.

Not a test file. Imported by the tests of this folder (pytest puts the folder on sys.path), and by the
gloo worker processes of `test_convert_rank_export.py` (PYTHONPATH set by the test).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TEMPLATES = ("llama", "qwen2", "qwen3", "mistral")


def make_hf_model(
    out: Path,
    model_type: str = "qwen2",
    *,
    tie: bool = False,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    hidden: int = 32,
    intermediate: int = 64,
    vocab: int = 99,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    **extra: Any,
) -> Path:
    """Build a random-init HF causal LM from a config and save it (safetensors) into `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=128,
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise them so a swapped tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def rewrite_tensors(hf_dir: Path, edit: Any) -> None:
    """Apply `edit(dict) -> dict` to a single-file HF directory's weights (for bad-input tests)."""
    path = Path(hf_dir) / "model.safetensors"
    tensors = edit(load_file(path))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def edit_config(hf_dir: Path, **changes: Any) -> None:
    """Change (value) or delete (None) keys of config.json."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def rank_export_worker(
    rank: int, world_size: int, port: int, cases: list[list[str]], tp: int, pp: int
) -> list[list[str]]:
    """Gloo worker: one training rank exports its own shard with `rank_mcore_to_hf` (TP all-gather inside).

    For each (mcore_dir, out_dir) case it writes `out_dir/rank<r>.safetensors` and returns the HF names.
    """
    import torch.distributed as dist

    from rlstages.engines.convert import ConversionSpec, rank_mcore_to_hf
    from rlstages.engines.convert.hf_to_mcore import rank_file
    from rlstages.engines.convert.safetensors_io import Reader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        tp_rank, pp_rank = rank % tp, rank // tp  # megatron's default order: tp fastest
        tp_group = None
        for p in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group([p * tp + t for t in range(tp)])
            if p == pp_rank:
                tp_group = group
        names = []
        for mcore_dir, out_dir in cases:
            spec = ConversionSpec.load(mcore_dir)
            reader = Reader(Path(mcore_dir) / rank_file(tp_rank, pp_rank, pp))
            local = ((name, reader.get(name)) for name in reader)
            out = dict(rank_mcore_to_hf(local, spec, pp_rank=pp_rank, tp_group=tp_group))
            save_file(out, str(Path(out_dir) / f"rank{rank}.safetensors"))
            names.append(sorted(out))
        return names
    finally:
        dist.destroy_process_group()
