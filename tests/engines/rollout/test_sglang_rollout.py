"""SGLangRolloutEngine: its calls checked against the installed SGLang's real signatures.

SGLang has no CPU build, so the engine cannot run on a CPU machine. Where `sglang` imports (a GPU machine with
`pip install -e ".[sglang]"`), the keyword names this engine passes to `sglang.Engine`, `generate`,
`update_weights_from_tensor` (and its flattened-bucket payload: `FlattenedTensorBucket`,
`MultiprocessingSerializer`), `release/resume_memory_occupation` and the sampling dict are checked with
`inspect` against that install; elsewhere those tests skip with the import error as the reason. The
argument-mapping tests run everywhere. Run:

    .venv/bin/python -m pytest -q tests/engines/rollout/test_sglang_rollout.py
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from rlstages.engines.base import RolloutEngine
from rlstages.engines.rollout.sglang_rollout import SGLangRolloutEngine, engine_kwargs, request_params
from rlstages.engines.types import SamplingParams


@pytest.fixture(scope="module")
def sglang_api() -> dict[str, Any]:
    try:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.sampling.sampling_params import SamplingParams as SGLSamplingParams
        from sglang.srt.server_args import ServerArgs
    except Exception as err:  # ImportError, or CUDA-only modules failing at import on a CPU machine
        pytest.skip(f"sglang does not import here (GPU-only, no CPU build): {type(err).__name__}: {err}")
    return {"Engine": Engine, "ServerArgs": ServerArgs, "Sampling": SGLSamplingParams, "tags": GPU_MEMORY_ALL_TYPES}


def field_names(cls: type) -> set[str]:
    """Constructor field names of a msgspec Struct, a dataclass, or any class with a plain signature."""
    if hasattr(cls, "__struct_fields__"):
        return set(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


def params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_engine_kwargs_are_server_args(sglang_api) -> None:
    ours = set(engine_kwargs("m", "bfloat16", 1, 0.5, True, 1024, 0, max_images=2))  # with a VLM's image limit
    assert ours <= field_names(sglang_api["ServerArgs"]), ours - field_names(sglang_api["ServerArgs"])


def test_method_keywords_match(sglang_api) -> None:
    engine = sglang_api["Engine"]
    assert {"input_ids", "sampling_params", "return_logprob", "image_data"} <= params(engine.generate)
    assert {"named_tensors", "flush_cache"} <= params(engine.update_weights_from_tensor)
    assert "tags" in params(engine.release_memory_occupation)
    assert "tags" in params(engine.resume_memory_occupation)
    assert callable(engine.flush_cache) and callable(engine.shutdown)
    # split placement's collective sync (engines/sync/collective/flat.py) and the weight-update session around loads
    group = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
    assert group <= params(engine.init_weights_update_group)
    flat = {"names", "dtypes", "shapes", "group_name", "flush_cache", "load_format"}
    assert flat <= params(engine.update_weights_from_distributed)
    assert "group_name" in params(engine.destroy_weights_update_group)
    assert callable(engine.begin_weight_update) and callable(engine.end_weight_update)
    assert {"weights", "kv_cache", "cuda_graph"} <= set(sglang_api["tags"])


def test_flattened_bucket_api_matches(sglang_api) -> None:
    """The colocated push (`flattened_payloads`): SGLang's bucket, serializer and the load format keyword."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    assert "named_tensors" in params(FlattenedTensorBucket)
    assert callable(FlattenedTensorBucket.get_flattened_tensor) and callable(FlattenedTensorBucket.get_metadata)
    assert "output_str" in params(MultiprocessingSerializer.serialize)
    assert callable(monkey_patch_torch_reductions)
    assert {"named_tensors", "load_format", "flush_cache"} <= params(sglang_api["Engine"].update_weights_from_tensor)


def test_sampling_keys_are_sglang_sampling_params(sglang_api) -> None:
    keys = set(request_params(SamplingParams(n=4, stop=("\n",)), 1, [7]))  # with a VLM's vision-token bias
    assert keys <= field_names(sglang_api["Sampling"]), keys - field_names(sglang_api["Sampling"])


def test_request_params_mapping() -> None:
    sampling = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, stop=("</answer>",))
    p = request_params(sampling, seed=5)
    assert p == {
        "n": 1,  # rows are replicated by the engine, one sample per request, to keep prompt-major order
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 12,
        "stop": ["</answer>"],
        "sampling_seed": 5,
    }
    assert request_params(SamplingParams(top_k=20), 0)["top_k"] == 20
    assert request_params(SamplingParams(), 0)["stop"] is None


def test_engine_has_the_rollout_protocol_methods() -> None:
    for name in ("generate", "update_weights", "sleep", "wake"):
        ours = inspect.signature(getattr(SGLangRolloutEngine, name))
        proto = inspect.signature(getattr(RolloutEngine, name))
        assert list(ours.parameters) == list(proto.parameters), name


def test_stream_calls_match(sglang_api) -> None:
    """The partial-rollout stream (engines/rollout/sglang_streaming.py) uses these, written against SGLang's API."""
    engine = sglang_api["Engine"]
    assert {"input_ids", "sampling_params", "return_logprob", "stream", "rid"} <= params(engine.async_generate)
    assert "mode" in params(engine.pause_generation)
    assert callable(engine.continue_generation)
