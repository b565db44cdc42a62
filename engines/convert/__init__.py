"""HF <-> Megatron-Core checkpoint conversion: templates of weight ops, TP/PP sharding, streaming I/O.

Pure tensor mapping: nothing here imports megatron-core (its parity gate and dist checkpoint are in
`rlstages.engines.megatron`). Public API:

    register_template / get_template / registered_templates    one template per HF model_type
    Rename, Stack, QKV, QKVBias, Concat, Drop                   the weight ops
    ConversionSpec, transformer_config_kwargs                   Megatron config of an HF config + layout
    convert_hf_to_mcore(hf_path, out_path, tp, pp, vpp)         HF dir -> rank files (+ extra outputs)
    convert_mcore_to_hf(mcore_path, out_path)                   rank files -> HF dir
    mcore_to_hf(dir | rank state dicts)                         streamed (hf_name, tensor) pairs
    rank_mcore_to_hf(named_tensors, spec, tp_group=...)         the same from one training rank
    load_rank_chunk(dir, spec, tp_rank, pp_rank, vp_stage)      one rank's converted state dict
    verify_manifest(dir)                                        checksums of an output directory
"""

from rlstages.engines.convert.hf_to_mcore import convert_hf_to_mcore, hf_weight_files, load_rank_chunk, read_hf_config
from rlstages.engines.convert.manifest import read_manifest, verify_manifest
from rlstages.engines.convert.mcore_to_hf import convert_mcore_to_hf, mcore_to_hf, rank_mcore_to_hf
from rlstages.engines.convert.ops import (
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
from rlstages.engines.convert.spec import ConversionSpec, transformer_config_kwargs
from rlstages.engines.convert.stream import ConversionError
from rlstages.engines.convert.template import Template, register_template
from rlstages.engines.convert.templates import get_template, registered_templates

__all__ = [
    "QKV",
    "AttentionDims",
    "Concat",
    "ConversionError",
    "ConversionSpec",
    "Drop",
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
]
