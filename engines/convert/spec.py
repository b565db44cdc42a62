"""ConversionSpec: one model's template, its flat Megatron config and the parallel layout, checked once.

The flat Megatron config holds TransformerConfig fields plus the GPTModel arguments in `GPT_MODEL_KEYS`
(`padded_vocab_size` is GPTModel's `vocab_size`). It is what `mcore_config.json` stores and what the
Megatron builders in `rlstages.engines.megatron.gpt` read. Non-goal: tensors and files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rlstages.engines.convert.ops import AttentionDims
from rlstages.engines.convert.sharding import LayerMap
from rlstages.engines.convert.template import Template, lookup
from rlstages.engines.convert.templates import get_template

TransformerImpl = Literal["local", "transformer_engine"]
GPT_MODEL_KEYS = {
    "padded_vocab_size": "vocab_size",
    "max_sequence_length": "max_sequence_length",
    "share_embeddings_and_output_weights": "share_embeddings_and_output_weights",
    "position_embedding_type": "position_embedding_type",
    "rotary_percent": "rotary_percent",
    "rotary_base": "rotary_base",
    "rope_scaling": "rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
}
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size")
SPEC_FILE = "mcore_config.json"
# Megatron hard-codes Llama-3 rope scaling's other parameters; other values cannot be expressed.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ConversionSpec:
    """Template + flat Megatron config + parallel sizes of one conversion."""

    template: Template
    hf_config: dict[str, Any]
    mcore: dict[str, Any]
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    transformer_impl: TransformerImpl = "local"
    hf_vocab_size: int = 0
    ep: int = 1
    first_stage_layers: int | None = None  # megatron-core's num_layers_in_first_pipeline_stage (uneven PP)
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage
    etp: int | None = None  # expert tensor parallel size (megatron-core's); None = tp
    layer_map: LayerMap = field(init=False)

    def __post_init__(self) -> None:
        layers = LayerMap(self.mcore["num_layers"], self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers)
        object.__setattr__(self, "layer_map", layers)

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Mapping[str, Any],
        tp: int = 1,
        pp: int = 1,
        vpp: int | None = None,
        transformer_impl: TransformerImpl = "local",
        vocab_divisible_by: int = 1,
        *,
        ep: int = 1,
        first_stage_layers: int | None = None,
        last_stage_layers: int | None = None,
        etp: int | None = None,
    ) -> ConversionSpec:
        """Build and check a spec from an HF config dict (config.json's contents); `ep` = expert parallel size,
        `etp` = expert tensor parallel size (None: tp), `first_stage_layers` / `last_stage_layers` = megatron-core's
        uneven first / last pipeline stage."""
        _check_sizes(tp, pp, vpp or 1, transformer_impl, ep)
        model_type = hf_config.get("model_type")
        if not model_type:
            raise ValueError("HF config has no 'model_type'; expected config.json of a transformers model")
        template = get_template(model_type)
        resolved = _with_hf_defaults(dict(hf_config))
        mcore = template.mcore_config(resolved)
        missing = [f"{template.hf_key_for(k)!r} (Megatron {k})" for k in REQUIRED if k not in mcore]
        if missing:
            raise ValueError(f"HF config ({model_type}) is missing {', '.join(missing)}")
        mcore.update(_rope_settings(resolved, mcore))
        if transformer_impl == "transformer_engine" and mcore.get("num_moe_experts"):
            mcore["moe_grouped_gemm"] = True  # TEGroupedMLP: experts.linear_fc1.weight<E> (sharding.to_te_name)
        mcore.setdefault("num_query_groups", mcore["num_attention_heads"])
        mcore.setdefault("kv_channels", mcore["hidden_size"] // mcore["num_attention_heads"])
        mcore.setdefault("share_embeddings_and_output_weights", False)
        hf_vocab = int(mcore["padded_vocab_size"])
        multiple = max(1, vocab_divisible_by) * tp
        mcore["padded_vocab_size"] = math.ceil(hf_vocab / multiple) * multiple
        stages = (first_stage_layers, last_stage_layers)
        etp = None if etp == tp else etp
        _check_layout(mcore, tp, pp, vpp or 1, transformer_impl, ep, stages, etp)
        return cls(template, dict(hf_config), mcore, tp, pp, vpp or 1, transformer_impl, hf_vocab, ep, *stages, etp)

    @property
    def dims(self) -> AttentionDims:
        """Head counts for the fused QKV layout."""
        m = self.mcore
        return AttentionDims(m["num_attention_heads"], m["num_query_groups"], m["kv_channels"])

    @property
    def tied(self) -> bool:
        """Input embedding and output layer share weights."""
        return bool(self.mcore.get("share_embeddings_and_output_weights"))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return int(self.mcore.get("num_moe_experts") or 0)

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallel size: each routed expert is split over this many ranks (a divisor of tp; the
        rank file of TP rank t holds expert-TP shard t % expert_tp, as megatron-core's rank order places it)."""
        return self.etp or self.tp

    @property
    def experts_per_rank(self) -> int:
        """Routed experts each expert-parallel rank holds (contiguous: EP rank e has [e*n, (e+1)*n))."""
        return self.num_experts // self.ep

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) is a Mixture-of-Experts layer (Megatron's `moe_layer_freq`)."""
        return moe_layer_pattern(self.mcore)[layer] == 1

    def with_layout(
        self,
        tp: int,
        pp: int,
        vpp: int | None = None,
        ep: int | None = None,
        stages: tuple[int | None, int | None] | None = None,
        etp: int | None = None,
    ) -> ConversionSpec:
        """The same model (same padded vocab) under another parallel layout, re-checked (`ep` None: unchanged;
        `stages` = (first, last) stage layers, None: the spec's own at the same PP size, else even; `etp` None:
        expert TP = tp)."""
        ep = self.ep if ep is None else ep
        etp = None if etp == tp else etp
        if stages is None:
            stages = self.stage_split if pp == self.pp else (None, None)
        if self.mcore["padded_vocab_size"] % tp:
            raise ValueError(f"padded_vocab_size={self.mcore['padded_vocab_size']} is not divisible by tp={tp}")
        _check_layout(self.mcore, tp, pp, vpp or 1, self.transformer_impl, ep, stages, etp)
        first, last = stages
        return replace(
            self, tp=tp, pp=pp, vpp=vpp or 1, ep=ep, first_stage_layers=first, last_stage_layers=last, etp=etp
        )

    @property
    def stage_split(self) -> tuple[int | None, int | None]:
        """(first, last) pipeline stage layers when set (megatron-core's uneven stages), else None."""
        return self.first_stage_layers, self.last_stage_layers

    @staticmethod
    def stage_fields(
        split: tuple[int | None, int | None], names: tuple[str, str] = ("first_stage_layers", "last_stage_layers")
    ) -> dict[str, int]:
        """A (first, last) stage split under `names`, only the sides that are set (an even split: {}): how
        mcore_config.json, the conversion cache key and TransformerConfig record it."""
        return {k: n for k, n in zip(names, split, strict=True) if n is not None}

    def pipeline_config(self) -> dict[str, Any]:
        """TransformerConfig's uneven-stage fields, set only when the split is uneven."""
        names = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
        return self.stage_fields(self.stage_split, names)

    def transformer_kwargs(self, resolve_callables: bool = True) -> dict[str, Any]:
        """TransformerConfig keyword arguments (without the GPTModel ones); activation names -> functions."""
        out = {k: v for k, v in self.mcore.items() if k not in GPT_MODEL_KEYS}
        if resolve_callables and isinstance(out.get("activation_func"), str):
            out["activation_func"] = activation(out["activation_func"])
        return out

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """GPTModel keyword arguments (vocab_size, max_sequence_length, rotary settings, tying)."""
        return {GPT_MODEL_KEYS[k]: v for k, v in self.mcore.items() if k in GPT_MODEL_KEYS}

    def to_json(self) -> dict[str, Any]:
        """What `mcore_config.json` holds."""
        return {
            "template": self.template.hf_model_type,
            "template_module": self.template.module,
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "ep": self.ep,
            **({"etp": self.etp} if self.etp else {}),
            **self.stage_fields(self.stage_split),
            "transformer_impl": self.transformer_impl,
            "hf_vocab_size": self.hf_vocab_size,
            "model_cls": self.template.mcore_model_cls,
            "mcore": self.mcore,
            "hf_config": self.hf_config,
        }

    @classmethod
    def load(cls, directory: str | Path, import_module: bool = True) -> ConversionSpec:
        """Read `mcore_config.json` of a converted directory. With `import_module=False` the template must be
        registered already: the `template_module` the file names is never imported (untrusted metadata)."""
        path = Path(directory) / SPEC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found; expected a directory written by convert_hf_to_mcore")
        try:
            data = json.loads(path.read_text())
            name = str(data["template"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a conversion spec ({type(exc).__name__}: {exc})") from None
        template = get_template(name, data.get("template_module") if import_module else None)
        return cls(
            template, data["hf_config"], data["mcore"], data["tp"], data["pp"], data["vpp"],
            data["transformer_impl"], data["hf_vocab_size"], int(data.get("ep", 1)),
            data.get("first_stage_layers"), data.get("last_stage_layers"), data.get("etp"),
        )  # fmt: skip


def transformer_config_kwargs(hf_config: Mapping[str, Any], tp: int = 1, pp: int = 1, ep: int = 1) -> dict[str, Any]:
    """Megatron TransformerConfig kwargs for an HF config dict, through its template (for the trainer); MoE
    models carry their `num_moe_experts`, `moe_*` and `moe_layer_freq` fields (MLA ones for DeepSeek-V3)."""
    return ConversionSpec.from_hf_config(hf_config, tp, pp, ep=ep).transformer_kwargs()


def moe_layer_pattern(mcore: Mapping[str, Any]) -> list[int]:
    """Per global layer 1 (MoE) or 0 (dense), from `num_moe_experts` and `moe_layer_freq` as Megatron reads
    them: an int N puts an MoE layer at every layer i with i % N == 0; a list gives the pattern itself."""
    layers = int(mcore["num_layers"])
    if not mcore.get("num_moe_experts"):
        return [0] * layers
    freq = mcore.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    pattern = [int(x) for x in freq]
    if len(pattern) != layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries, expected one per layer ({layers})")
    return pattern


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu"}


def activation(name: str) -> Callable[..., Any]:
    """torch.nn.functional activation for an HF `hidden_act` name."""
    import torch.nn.functional as F

    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} has no Megatron equivalent here; known: {sorted(_ACTIVATIONS)}")
    return getattr(F, _ACTIVATIONS[name])


def _with_hf_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """Fill keys config.json left out with transformers' defaults for its model_type (raw keys win)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
        defaults = config.to_dict()
    except (ValueError, KeyError, TypeError):  # model_type unknown to transformers: take config.json as is
        return raw
    return {**defaults, **raw}


def _rope_settings(hf: Mapping[str, Any], mcore: Mapping[str, Any]) -> dict[str, Any]:
    if mcore.get("position_embedding_type") != "rope" or mcore.get("multi_latent_attention"):
        return {}  # MLA templates map their RoPE (incl. YaRN) into MLATransformerConfig fields themselves
    params = lookup(hf, "rope_parameters")
    params = params if isinstance(params, Mapping) else (hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return {}
    if rope_type == "llama3":
        for key, expected in _LLAMA3_ROPE.items():
            if float(params.get(key, expected)) != expected:
                raise ValueError(
                    f"rope_parameters.{key}={params[key]}: Megatron's llama3 rope scaling fixes it at {expected}"
                )
        return {"rope_scaling": True, "rope_scaling_factor": float(params.get("factor", 8.0))}
    raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported by the converter (default, llama3)")


def _check_sizes(tp: int, pp: int, vpp: int, impl: str, ep: int = 1) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if vpp > 1 and pp < 2:
        raise ValueError(f"vpp={vpp} needs pp >= 2 (virtual pipeline chunks interleave pipeline stages)")
    if impl not in ("local", "transformer_engine"):
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {impl!r}")


def _check_layout(
    m: Mapping[str, Any],
    tp: int,
    pp: int,
    vpp: int,
    impl: str,
    ep: int = 1,
    stages: tuple[int | None, int | None] = (None, None),
    etp: int | None = None,
) -> None:
    _check_sizes(tp, pp, vpp, impl, ep)
    _check_moe(m, tp, ep, etp)
    heads, groups = m["num_attention_heads"], m["num_query_groups"]
    if m.get("multi_latent_attention"):
        groups = heads  # MLA has no query groups: every head has its own (up-projected) key and value
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    for field_name, hf_name in (
        ("num_attention_heads", "num_attention_heads"),
        ("num_query_groups", "num_key_value_heads"),
        ("ffn_hidden_size", "intermediate_size"),
    ):
        if field_name == "num_query_groups" and m.get("multi_latent_attention"):
            continue
        if m[field_name] % tp:
            raise ValueError(f"{hf_name}={m[field_name]} is not divisible by tensor parallel size tp={tp}")
    if m.get("add_bias_linear") and not m.get("add_qkv_bias"):
        raise ValueError(
            "add_bias_linear without add_qkv_bias: Megatron would give linear_qkv a bias the HF model lacks "
            "(Llama mlp_bias=True needs attention_bias=True)"
        )
    LayerMap(m["num_layers"], pp, vpp, *stages)


def _check_moe(m: Mapping[str, Any], tp: int, ep: int, etp: int | None = None) -> None:
    experts = int(m.get("num_moe_experts") or 0)
    if not experts:
        if ep > 1 or etp:
            name = f"ep={ep}" if ep > 1 else f"etp={etp}"
            raise ValueError(f"{name}: expert parallelism needs a Mixture-of-Experts model (this one is dense)")
        return
    if experts % ep:
        raise ValueError(f"num_experts={experts} is not divisible by expert parallel size ep={ep}")
    if etp is not None and (not isinstance(etp, int) or etp < 1 or tp % etp):
        raise ValueError(
            f"etp={etp!r}: the expert tensor parallel size must divide tp={tp} (expert TP larger than TP is not "
            "supported by the converter)"
        )
    for field_name, hf_name, size, what in (
        ("moe_ffn_hidden_size", "moe_intermediate_size", etp or tp, f"expert tensor parallel size {etp or tp}"),
        ("moe_shared_expert_intermediate_size", "n_shared_experts x moe_intermediate_size", tp, f"tp={tp}"),
    ):
        if m.get(field_name) and m[field_name] % size:
            raise ValueError(f"{hf_name}={m[field_name]} is not divisible by {what}")
    moe_layer_pattern(m)
