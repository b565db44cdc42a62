"""Tiny random Mixture-of-Experts HF models (qwen3_moe, mixtral, deepseek_v3) saved as real safetensors dirs.

Not a test file: imported by the MoE conversion tests (pytest puts this folder on sys.path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MOE_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3")

# Per model type: the config keys of a tiny model (hidden 32, 4 experts, top-2, 2 layers).
TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "intermediate_size": 64,
        "norm_topk_prob": True,
        "head_dim": 8,
        "num_key_value_heads": 2,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "num_key_value_heads": 2},
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "intermediate_size": 64,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "num_key_value_heads": 4,
        "topk_method": "noaux_tc",  # DeepSeek-V3's config.json keys that transformers ignores and vLLM reads
        "scoring_func": "sigmoid",
    },
}


def make_moe_model(
    out: Path,
    model_type: str = "qwen3_moe",
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    vocab: int = 99,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **extra: Any,
) -> Path:
    """Build a random-init tiny MoE causal LM and `save_pretrained` it (the on-disk, per-expert layout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {**TINY[model_type], **extra}
    config = AutoConfig.for_model(
        model_type,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=128,
        **kwargs,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # norms start at 1, biases at 0: randomise them so a swapped tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias starts at 0
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(out)
    return out


def ep_export_worker(
    rank: int, world_size: int, port: int, mcore_dir: str, out_dir: str, tp: int, ep: int
) -> list[str]:
    """Gloo worker: one training rank of a TP x EP grid exports its shard with `rank_mcore_to_hf` (TP gather,
    then the routed experts gathered over the EP group); writes `out_dir/rank<r>.safetensors`, returns names."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from rlstages.engines.convert import ConversionSpec, rank_mcore_to_hf
    from rlstages.engines.convert.hf_to_mcore import spec_rank_file
    from rlstages.engines.convert.safetensors_io import Reader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        tp_rank, ep_rank = rank % tp, rank // tp  # TP fastest, then EP (megatron-core's expert grid)
        groups = {}
        for e in range(ep):  # every rank creates every group, in the same order
            groups[("tp", e)] = dist.new_group([e * tp + t for t in range(tp)])
        for t in range(tp):
            groups[("ep", t)] = dist.new_group([e * tp + t for e in range(ep)])
        spec = ConversionSpec.load(mcore_dir)
        reader = Reader(Path(mcore_dir) / spec_rank_file(spec, tp_rank, 0, ep_rank))
        local = ((name, reader.get(name)) for name in reader)
        out = dict(rank_mcore_to_hf(local, spec, tp_group=groups[("tp", ep_rank)], ep_group=groups[("ep", tp_rank)]))
        save_file(out, str(Path(out_dir) / f"rank{rank}.safetensors"))
        return sorted(out)
    finally:
        dist.destroy_process_group()
