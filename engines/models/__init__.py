"""Models: the registry of model types and their loaders (`registry`), and the providers that build a model
directory on first use (`providers`)."""

import logging

from rlstages.engines.models.hub import hub_cache_dir, is_hub_id, resolve_model_path
from rlstages.engines.models.providers import (
    build_smollm2,
    build_tiny_model,
    ensure_model,
    planned_config,
    start_model_build,
)
from rlstages.engines.models.registry import (
    PLUGINS_ENV,
    eos_token_ids,
    import_plugins,
    load_causal_lm,
    load_tokenizer,
    meta_causal_lm,
    read_model_type,
    register_model,
    registered_models,
    save_causal_lm,
    saved_generation_config,
)
from rlstages.engines.utils import torch_dtype

# transformers imports torchao where it is installed (rlstages no longer needs it) while loading a model; on a CPU
# machine its CUDA kernels fail to load with one warning each, which is noise
logging.getLogger("torchao").setLevel(logging.ERROR)

__all__ = [
    "PLUGINS_ENV",
    "build_smollm2",
    "build_tiny_model",
    "eos_token_ids",
    "ensure_model",
    "start_model_build",
    "hub_cache_dir",
    "is_hub_id",
    "import_plugins",
    "load_causal_lm",
    "load_tokenizer",
    "save_causal_lm",
    "saved_generation_config",
    "meta_causal_lm",
    "planned_config",
    "read_model_type",
    "register_model",
    "registered_models",
    "resolve_model_path",
    "torch_dtype",
]
