"""Pre-flight: every input a run depends on is checked before a directory, Ray, Prefect or MLflow starts.

`preflight(cfg)` raises `PreflightError` (one line: the field or file, and what was expected) for the first
problem, cheapest checks first: the run directory, `RLSTAGES_FAULTS`, the model directory (config.json and
every safetensors header), the data files, what the config asks to import (reward `module:function`,
`model.plugins`; a deployment may import only its allow-list), Megatron context parallelism without
Transformer Engine, and prompts that do not fit the model's
context. Nothing here imports torch unless a prompt needs the tokenizer to be measured.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, get_args

from rlstages.configs import RunConfig
from rlstages.configs.data import JsonlDataConfig
from rlstages.configs.run import RUN_NAME
from rlstages.configs.stages import StageName

ALLOWED_IMPORTS_ENV = "RLSTAGES_ALLOWED_IMPORTS"
TEMPLATE_SLACK = 64  # tokens a chat template and system prompt may add around a prompt, for the cheap bound


class PreflightError(ValueError):
    """An input a run cannot start with; the message names the field or file and what was expected."""


def preflight(cfg: RunConfig, measure_prompts: bool = True) -> list[str]:
    """Check everything a run needs before anything starts; returns warnings (e.g. prompts to be truncated)."""
    check_run_name(cfg)
    check_faults()
    check_model_dir(cfg.model.path, "model.path", required=cfg.model.provider == "local")
    if cfg.reward.reward_model is not None:
        check_model_dir(cfg.reward.reward_model.path, "reward.reward_model.path", required=True)
    check_data(cfg)
    check_imports(cfg)
    check_context_parallel(cfg)
    return check_prompt_lengths(cfg) if measure_prompts else []


def check_context_parallel(cfg: RunConfig) -> None:
    """Megatron context parallelism needs Transformer Engine's attention (megatron-core's local attention
    asserts CP = 1): refused here, before any worker starts, where transformer_engine is not installed."""
    for role in ("actor", "critic"):
        cp = getattr(getattr(cfg, role), "context_parallel_size", 1)
        if cp > 1 and importlib.util.find_spec("transformer_engine") is None:
            raise PreflightError(
                f"{role}.context_parallel_size={cp}: megatron-core splits attention over CP ranks only with "
                "Transformer Engine, which is not installed; use 1 or install transformer_engine"
            )


def check_run_name(cfg: RunConfig) -> None:
    """The run directory is a plain child of trainer.output_dir (never `..`, a path, or a file in the way)."""
    name = cfg.trainer.run_name
    if name is not None and not RUN_NAME.fullmatch(name):
        raise PreflightError(f"trainer.run_name: {name!r} is not a run name (letters, digits, '_' and '-')")
    out = cfg.trainer.output_dir
    if out.exists() and not out.is_dir():
        raise PreflightError(f"trainer.output_dir: {out} exists and is not a directory")
    if name is not None and (out / name).exists() and not (out / name).is_dir():
        raise PreflightError(f"trainer.run_name: {out / name} exists and is not a run directory")


def check_faults() -> None:
    """`RLSTAGES_FAULTS` parses and names known stages and kinds."""
    from rlstages.tasks.faults import parse_faults

    try:
        parse_faults(stages=get_args(StageName))
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def check_model_dir(path: Path, field: str, required: bool = True) -> None:
    """An HF directory: config.json parses as an object, and every *.safetensors has a complete header."""
    if not path.exists():
        if required:
            raise PreflightError(f"{field}: {path} does not exist (expected an HF model directory)")
        return  # a provider builds it on first use
    if not path.is_dir():
        raise PreflightError(f"{field}: {path} is not a directory (expected an HF model directory)")
    config = path / "config.json"
    if not config.is_file():
        if not required and not any(path.iterdir()):
            return
        raise PreflightError(f"{field}: {config} is missing (expected the model's HF config)")
    raw = _read_json(config, field)
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type", ""), str):
        raise PreflightError(f"{field}: {config} is not an HF config (expected a JSON object with model_type)")
    weights = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        mapping = _read_json(index, field).get("weight_map", {})
        for name in sorted(set(mapping.values()) if isinstance(mapping, dict) else ()):
            if not (path / name).is_file():
                raise PreflightError(f"{field}: {path / name} is named in {index.name} but missing")
    if not weights and not any(path.glob("*.gguf")):
        raise PreflightError(f"{field}: {path} has no *.safetensors weights")
    for file in weights:
        check_safetensors(file, field)


def check_safetensors(file: Path, field: str) -> None:
    """The safetensors header of `file` is readable and every tensor's bytes are in the file."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            length = int.from_bytes(head, "little")
            if length <= 0 or 8 + length > size:
                raise ValueError(f"header length {length} does not fit the file's {size} bytes")
            header = json.loads(fh.read(length))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise PreflightError(f"{field}: {file} is not a readable safetensors file ({exc})") from None
    if 8 + length + end > size:
        raise PreflightError(
            f"{field}: {file} is truncated ({size} bytes, its header needs {8 + length + end}); copy it again"
        )


def _read_json(path: Path, field: str) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PreflightError(f"{field}: {path} is not valid JSON ({type(exc).__name__}: {exc})") from None


def check_data(cfg: RunConfig) -> None:
    """JSONL files exist, are UTF-8, non-empty, and every row is an object with the prompt and answer keys."""
    source = cfg.data.source
    if not isinstance(source, JsonlDataConfig):
        return
    paths = [("data.source.train_path", source.train_path)]
    if source.eval_path is not None:
        paths.append(("data.source.eval_path", source.eval_path))
    for field, path in paths:
        _check_jsonl(path, field, source.prompt_key, source.answer_key)


def _check_jsonl(path: Path, field: str, prompt_key: str, answer_key: str) -> None:
    if not path.is_file():
        raise PreflightError(f"{field}: {path} does not exist (expected a JSONL file)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PreflightError(f"{field}: {path} is not UTF-8 (byte {exc.start}); save it as UTF-8") from None
    rows = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PreflightError(f"{field}: {path}:{n} is not JSON ({exc.msg})") from None
        missing = [k for k in (prompt_key, answer_key) if not isinstance(obj, dict) or k not in obj]
        if missing:
            raise PreflightError(
                f"{field}: {path}:{n} lacks {', '.join(repr(k) for k in missing)} (expected a JSON object with "
                f"{prompt_key!r} and {answer_key!r}; see data.source.prompt_key/answer_key)"
            )
        rows += 1
    if rows == 0:
        raise PreflightError(f"{field}: {path} has no rows (expected one JSON object per line)")


def import_targets(cfg: RunConfig) -> list[tuple[str, str]]:
    """(field, module) of every module the config asks workers to import."""
    out = [(f"reward.functions.{i}.name", f.name.partition(":")[0]) for i, f in enumerate(cfg.reward.functions)]
    out = [(field, module) for (field, module), f in zip(out, cfg.reward.functions, strict=True) if ":" in f.name]
    out += [(f"model.plugins.{i}", name) for i, name in enumerate(cfg.model.plugins)]
    return out


def allowed_imports() -> tuple[str, ...] | None:
    """The deployment's allow-list (set by `rlstages deploy --allow-import`), or None outside deployments."""
    raw = os.environ.get(ALLOWED_IMPORTS_ENV)
    if raw is None:
        return None
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def check_import_allowed(cfg: RunConfig) -> None:
    """In a deployment, every module the run's parameters name must be on the deploy-time allow-list."""
    allowed = allowed_imports()
    if allowed is None:
        return
    for field, module in import_targets(cfg):
        if not any(module == a or module.startswith(f"{a}.") for a in allowed):
            raise PreflightError(
                f"{field}: module {module!r} is not on this deployment's import allow-list "
                f"({', '.join(allowed) or 'empty'}); redeploy with --allow-import {module}"
            )


def check_imports(cfg: RunConfig) -> None:
    """Allowed, then importable: reward functions resolve to callables, plugins import."""
    check_import_allowed(cfg)
    from rlstages.engines.rewards.registry import REWARD_FUNCTIONS, resolve_reward_fn

    for i, fn in enumerate(cfg.reward.functions):
        if ":" not in fn.name and fn.name in REWARD_FUNCTIONS:
            continue  # built-in: its module ships with us
        try:
            resolve_reward_fn(fn.name)
        except ValueError as exc:
            raise PreflightError(f"reward.functions.{i}.name: {exc}") from None
    for i, name in enumerate(cfg.model.plugins):
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            found, detail = None, str(exc)
        else:
            detail = "not found"
        if found is None:
            raise PreflightError(f"model.plugins.{i}: cannot import module {name!r} ({detail})")


def context_length(cfg: RunConfig) -> int | None:
    """The model's context (max_position_embeddings), from the tiny spec or config.json."""
    if cfg.model.tiny is not None:
        return cfg.model.tiny.max_position_embeddings
    config = cfg.model.path / "config.json"
    if not config.is_file():
        return None
    raw = _read_json(config, "model.path")
    value = raw.get("max_position_embeddings") or raw.get("n_positions")
    return int(value) if isinstance(value, int) else None


def check_prompt_lengths(cfg: RunConfig) -> list[str]:
    """Prompts + rollout.max_new_tokens fit the context: refused (data.overlong_prompts=error) or reported."""
    context = context_length(cfg)
    if context is None:
        return []
    limit = context - cfg.rollout.max_new_tokens
    if limit <= 0:
        raise PreflightError(
            f"rollout.max_new_tokens: {cfg.rollout.max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {context} tokens"
        )
    from rlstages.tasks.data import load_rows

    rows = [(split, i, row.text) for split in ("train", "eval") for i, row in enumerate(load_rows(cfg.data, split))]
    system = len((cfg.data.system_prompt or "").encode())
    # a token covers at least one byte for the tokenizers we use: short prompts need no tokenizer
    suspects = [r for r in rows if len(r[2].encode()) + system + TEMPLATE_SLACK > limit]
    if not suspects:
        return []
    lengths = _token_lengths(cfg, [r[2] for r in suspects])
    long = [(split, i, n) for (split, i, _), n in zip(suspects, lengths, strict=True) if n > limit]
    if not long:
        return []
    split, i, n = long[0]
    what = f"{len(long)} prompt(s) longer than {limit} tokens (context {context} - rollout.max_new_tokens)"
    if cfg.data.overlong_prompts == "error":
        raise PreflightError(
            f"data.overlong_prompts: {what}, e.g. {split} row {i} with {n} tokens; shorten them or set "
            "data.overlong_prompts=truncate"
        )
    return [f"{what} are truncated to their last {limit} tokens (data.overlong_prompts=truncate)"]


def _token_lengths(cfg: RunConfig, texts: list[str]) -> list[int]:
    from rlstages.engines.models import load_tokenizer
    from rlstages.engines.rollout.batching import format_prompts
    from rlstages.engines.types import Prompt

    tokenizer = load_tokenizer(cfg.model.path)
    prompts = [Prompt(uid=str(i), text=t, ground_truth="") for i, t in enumerate(texts)]
    ids = format_prompts(tokenizer, prompts, cfg.data.apply_chat_template, cfg.data.system_prompt)
    return [len(x) for x in ids]
