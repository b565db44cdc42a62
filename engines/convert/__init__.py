"""HF <-> Megatron-Core checkpoint conversion: templates of weight ops, TP/PP sharding, streaming I/O.

Public API (megatron-core is optional: only `verify_parity` and `dist_checkpoint=True` need it):

    register_template / get_template / registered_templates    one template per HF model_type
    Rename, Stack, QKV, QKVBias, Concat, Drop                   the weight ops
    ConversionSpec, transformer_config_kwargs                   Megatron config of an HF config + layout
    convert_hf_to_mcore(hf_path, out_path, tp, pp, vpp)         HF dir -> rank files (+ dist_ckpt)
    convert_mcore_to_hf(mcore_path, out_path)                   rank files -> HF dir
    mcore_to_hf(dir | rank state dicts)                         streamed (hf_name, tensor) pairs
    rank_mcore_to_hf(named_tensors, spec, tp_group=...)         the same from one training rank
    verify_parity(mcore_path, hf_path)                          logits of GPTModel vs HF (needs megatron-core)
    load_rank_chunk(dir, spec, tp_rank, pp_rank, vp_stage)      one rank's converted state dict
    verify_manifest(dir)                                        checksums of an output directory
"""

from engines.convert import templates as _builtin_templates  # noqa: F401  (registers the built-ins first)
from engines.convert.hf_to_mcore import convert_hf_to_mcore, hf_weight_files, read_hf_config
from engines.convert.manifest import read_manifest, verify_manifest
from engines.convert.mcore_to_hf import convert_mcore_to_hf, mcore_to_hf, rank_mcore_to_hf
from engines.convert.ops import (
    QKV,
    AttentionDims,
    Concat,
    Drop,
    QKVBias,
    Rename,
    RowConcat,
    Stack,
    StackedParts,
    WeightOp,
    materialize,
)
from engines.convert.parity import ParityReport, load_rank_chunk, verify_parity, verify_parity_many
from engines.convert.spec import ConversionSpec, transformer_config_kwargs
from engines.convert.stream import ConversionError
from engines.convert.template import Template, get_template, register_template, registered_templates

__all__ = [
    "QKV",
    "AttentionDims",
    "Concat",
    "ConversionError",
    "ConversionSpec",
    "Drop",
    "ParityReport",
    "QKVBias",
    "Rename",
    "RowConcat",
    "Stack",
    "StackedParts",
    "Template",
    "WeightOp",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "get_template",
    "hf_weight_files",
    "load_rank_chunk",
    "materialize",
    "mcore_to_hf",
    "rank_mcore_to_hf",
    "read_hf_config",
    "read_manifest",
    "register_template",
    "registered_templates",
    "transformer_config_kwargs",
    "verify_manifest",
    "verify_parity",
    "verify_parity_many",
]
