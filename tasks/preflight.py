"""Pre-flight: every input a run depends on is checked before a directory, Ray, Prefect or MLflow starts.

`preflight(cfg)` runs the checks of `CHECKS` in order, cheapest first, and raises `PreflightError` (one line:
the field or file, and what was expected) for the first problem; it returns warnings (e.g. prompts to be
truncated). What a run would find out only once it has started is rehearsed here where that is cheap: the
LoRA wrapper is built on the meta device, the tracking store's URI is opened without writing, a local
cluster's GPUs and CPUs are counted, data paths that look local must exist. `rlstages run`, `resume` and
`config show` run every check; `eval` and `deploy` skip the ones that do not apply to them.

Adding a check: write `def check_<what>(cfg: RunConfig) -> list[str] | None` that raises
`PreflightError("<field>: <value> <what is wrong>; <what was expected>")` and may return warnings, and put
it in `CHECKS` (cheap checks before expensive ones); a row in tests/flows/test_bad_inputs.py shows it works.
A check never creates, changes or starts anything.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, get_args

from rlstages.configs import RunConfig
from rlstages.configs.data import DatasetsDataConfig, JsonlDataConfig
from rlstages.configs.run import RUN_NAME
from rlstages.configs.stages import StageName

ALLOWED_IMPORTS_ENV = "RLSTAGES_ALLOWED_IMPORTS"
TEMPLATE_SLACK = 64  # tokens a chat template and system prompt may add around a prompt, for the cheap bound

Check = Callable[[RunConfig], "list[str] | None"]


class PreflightError(ValueError):
    """An input a run cannot start with; the message names the field or file and what was expected."""


def preflight(cfg: RunConfig, measure_prompts: bool = True, skip: Collection[Check] = ()) -> list[str]:
    """Run every check of `CHECKS` but those in `skip` (and the prompt measurement unless `measure_prompts`);
    returns their warnings. Any problem is a PreflightError (its message names the field or file)."""
    skipped = set(skip) | (set() if measure_prompts else {check_prompt_lengths})
    warnings: list[str] = []
    for check in CHECKS:
        if check in skipped:
            continue
        try:
            warnings += check(cfg) or []
        except PreflightError:
            raise
        except (ValueError, OSError) as exc:  # the checks that other modules own say the field or file too
            raise PreflightError(str(exc)) from None
    return warnings


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


def check_faults(cfg: RunConfig | None = None) -> None:
    """`RLSTAGES_FAULTS` parses and names known stages and kinds."""
    from rlstages.tasks.faults import parse_faults

    try:
        parse_faults(stages=get_args(StageName))
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def check_models(cfg: RunConfig) -> None:
    """The policy's directory (a provider may build it on first use) and the reward model's."""
    check_model_dir(cfg.model.path, "model.path", required=cfg.model.provider == "local")
    if cfg.reward.reward_model is not None:
        check_model_dir(cfg.reward.reward_model.path, "reward.reward_model.path", required=True)


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


def check_data_files(cfg: RunConfig) -> None:
    """JSONL files exist, are UTF-8, non-empty, and every row is an object with the prompt and answer keys; a
    `datasets` path that looks local (absolute, ./, ../, a data file suffix, a glob) names files that exist."""
    source = cfg.data.source
    if isinstance(source, DatasetsDataConfig):
        for field, value in (("data.source.path", source.path), ("data.source.eval_path", source.eval_path)):
            if value is not None:
                _check_dataset_path(value, field)
        return
    if not isinstance(source, JsonlDataConfig):
        return
    paths = [("data.source.train_path", source.train_path)]
    if source.eval_path is not None:
        paths.append(("data.source.eval_path", source.eval_path))
    for field, path in paths:
        _check_jsonl(path, field, source.prompt_key, source.answer_key)


def _check_dataset_path(path: str, field: str) -> None:
    """A local data path must name something; anything else is a hub dataset name (read in `check_data_rows`)."""
    from rlstages.tasks.data import DATA_SUFFIXES, is_glob, looks_local

    expected = f"expected a data file ({', '.join(DATA_SUFFIXES)}), a glob of them or a save_to_disk directory"
    if is_glob(path):
        if not glob.glob(path):
            raise PreflightError(f"{field}: {path} matches no file ({expected})")
    elif not Path(path).exists() and looks_local(path):
        raise PreflightError(f"{field}: {path} does not exist ({expected})")


def _check_jsonl(path: Path, field: str, prompt_key: str, answer_key: str) -> None:
    if path.is_dir():
        raise PreflightError(f"{field}: {path} is a directory (expected a JSONL file)")
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
    environment = cfg.rollout.multi_turn.environment
    if cfg.rollout.multi_turn.enabled and environment is not None:
        from rlstages.engines.tools.registry import import_targets as environment_targets

        out += environment_targets(environment, "rollout.multi_turn.environment")
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
            resolve_reward_fn(fn.name, f"reward.functions.{i}.name")
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
    for i, name in enumerate(cfg.model.plugins):
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            found, detail = None, str(exc)
        else:
            detail = "not found"
        if found is None:
            raise PreflightError(f"model.plugins.{i}: cannot import module {name!r} ({detail})")


def check_tracking_store(cfg: RunConfig) -> None:
    """The tracking URI (`tracking.tracking_uri`, else MLFLOW_TRACKING_URI, else the default) names a store
    MLflow can open: a known scheme, a database path that exists or can be created, a driver that imports.
    Nothing is opened for writing: a store that does not exist yet is created by the run, not here."""
    from rlstages.tasks.tracking import store_problem, tracking_uri_origin

    origin, uri = tracking_uri_origin(cfg)
    problem = store_problem(uri)
    if problem is not None:
        raise PreflightError(f"{origin}: {uri} {problem}")


def known_resources(cfg: RunConfig) -> tuple[float, float, str] | None:
    """(GPUs, CPUs, where) of the cluster the run's workers will use, when known before the start: the Ray this
    process already joined, a local Ray the run starts (this machine's GPUs; `cluster.num_cpus` or its CPUs),
    or this process (in_process). None for a cluster joined by address: its placement says (`tasks.placement`)."""
    ray = sys.modules.get("ray")
    if cfg.cluster.mode == "ray" and ray is not None and ray.is_initialized():  # start_ray keeps that one
        total = ray.cluster_resources()
        return total.get("GPU", 0.0), total.get("CPU", 0.0), "the Ray this process joined"
    if cfg.cluster.mode == "ray" and (cfg.cluster.address or os.environ.get("RAY_ADDRESS")):
        return None
    cpus = float(cfg.cluster.num_cpus or os.cpu_count() or 1)
    if cfg.cluster.mode == "in_process":
        return float(local_gpu_count()) if cfg.cluster.num_gpus else 0.0, cpus, "this process (cluster.mode=in_process)"
    where = "a local Ray: no cluster.address or RAY_ADDRESS"
    if cfg.cluster.num_cpus:
        where += f"; cluster.num_cpus={cfg.cluster.num_cpus}"
    return float(local_gpu_count()) if cfg.cluster.num_gpus else 0.0, cpus, where


def local_gpu_count() -> int:
    """GPUs a Ray started on this machine would see (`engines.runtime.device.visible_gpus`)."""
    from rlstages.engines.runtime.device import visible_gpus

    return visible_gpus()


def check_cluster_resources(cfg: RunConfig) -> None:
    """When the cluster's resources are known before the start (`known_resources`): `cluster.num_gpus` GPUs
    exist there, and the CPUs the placement groups reserve fit."""
    c = cfg.cluster
    known = known_resources(cfg)
    if known is None:
        return
    gpus, cpus, where = known
    if c.num_gpus > gpus:
        raise PreflightError(
            f"cluster.num_gpus: {c.num_gpus} GPUs asked for, but the workers run where there are {gpus:g} "
            f"({where}); lower cluster.num_gpus or join a cluster that has them"
        )
    if c.mode == "ray" and c.use_placement_group:
        from rlstages.tasks.placement import reserved_bundles

        bundles = reserved_bundles(cfg)
        need = bundles * c.cpus_per_bundle
        if need > cpus + 1e-9:
            raise PreflightError(
                f"cluster.cpus_per_bundle: the placement groups reserve {need:g} CPUs ({bundles} x "
                f"{c.cpus_per_bundle:g} per bundle) but the workers run where there are {cpus:g} ({where}); "
                "lower cluster.cpus_per_bundle or the worker counts"
            )


def check_lora_targets(cfg: RunConfig) -> list[str] | None:
    """`model.lora.target_modules` are linear layers of the model: the PEFT wrapper is built on the meta device
    (no memory, no weights) from the model's config -- config.json, the tiny spec, or the provider's
    architecture -- exactly as the actor's worker will build it."""
    lora = cfg.model.lora
    if lora is None:
        return None
    from rlstages.engines.models import import_plugins, meta_causal_lm, planned_config
    from rlstages.engines.models.lora import wrap_lora

    if cfg.model.plugins:  # custom model types register themselves (allowed and importable: checked above)
        import_plugins(",".join(cfg.model.plugins))
    tiny = cfg.model.tiny.model_dump() if cfg.model.tiny is not None else None
    try:
        config = planned_config(cfg.model.path, cfg.model.provider, tiny)
        model = meta_causal_lm(config, cfg.model.model_type) if config is not None else None
    except Exception as exc:  # noqa: BLE001 - a model we cannot rehearse is left to the worker, said once
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        return [f"model.lora.target_modules: not checked before the start ({type(exc).__name__}: {detail})"]
    if model is None:
        return None  # a hub id or a model built on first use by a provider of unknown architecture
    try:
        with warnings.catch_warnings():  # transformers' deprecation notes are the worker's business
            warnings.simplefilter("ignore")
            wrap_lora(model, lora.model_dump())
    except ValueError as exc:
        raise PreflightError(str(exc).replace("model.lora.target_modules ", "model.lora.target_modules: ", 1)) from None
    return None


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


MULTI_TURN_BACKENDS = ("hf", "vllm")


def check_multi_turn(cfg: RunConfig) -> None:
    """`rollout.multi_turn`: a backend that runs it, a chat template, no stop strings (turns end at EOS), an
    environment whose classes import, and, once the model exists, a prefix-preserving template or `new_row` and
    an assistant prefill that fits; `tool_call_format` only with multi-turn rollouts."""
    mt = cfg.rollout.multi_turn
    field = "rollout.multi_turn"
    if not mt.enabled:
        for i, fn in enumerate(cfg.reward.functions):
            if fn.name == "tool_call_format":
                raise PreflightError(
                    f"reward.functions.{i}.name: tool_call_format scores the tool calls of multi-turn rollouts; "
                    f"expected {field}.enabled=true"
                )
        return
    if cfg.rollout.backend not in MULTI_TURN_BACKENDS:
        raise PreflightError(
            f"{field}.enabled: multi-turn rollouts run on rollout.backend {' or '.join(MULTI_TURN_BACKENDS)}, "
            f"not {cfg.rollout.backend!r}"
        )
    if cfg.rollout.stop:
        raise PreflightError(f"{field}.enabled: rollout.stop must be empty (a policy turn ends at its EOS token)")
    if not cfg.data.apply_chat_template:
        raise PreflightError(f"{field}.enabled: needs data.apply_chat_template=true (turns are chat messages)")
    if mt.environment is not None:
        from rlstages.engines.tools import check_environment_spec

        try:
            check_environment_spec(mt.environment, allowed_imports(), f"{field}.environment")
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
    check_multi_turn_template(cfg)


def check_tool_isolation(cfg: RunConfig) -> list[str] | None:
    """Each `python` tool of a multi-turn run: reports which isolation layers this machine provides (the
    rollout workers check again on their own machines); refuses one that requires isolation (the default)
    where a layer is missing; reports one whose config says `require_isolation: false`."""
    mt = cfg.rollout.multi_turn
    if not mt.enabled or mt.environment is None or mt.environment.environment != "default":
        return None
    from rlstages.engines.tools.isolation import probe_now

    notes = []
    for i, tool in enumerate(mt.environment.tools):
        if tool.name != "python":
            continue
        field = f"rollout.multi_turn.environment.tools.{i}.kwargs.require_isolation"
        if tool.kwargs.get("require_isolation", True) is False:
            notes.append(
                f"{field}=false: the python tool runs programs without file-system isolation, seccomp "
                "or a non-root identity (network and PID namespaces and rlimits only)"
            )
            continue
        found = probe_now(tool.kwargs.get("python"), tool.kwargs.get("isolation_backend", "auto"))
        if found["missing"] is not None:
            raise PreflightError(
                f"{field}: this machine cannot isolate the python tool: {found['missing']}; "
                "run `make sandbox-env` (as root) or set it to false"
            )
        layers = "; ".join(f"{k}: {v}" for k, v in found["layers"].items())
        notes.append(f"python tool isolation on this machine: {layers}")
    return notes


def check_multi_turn_template(cfg: RunConfig) -> None:
    """The model's chat template (or data.chat_template) exists and is prefix-preserving, or `new_row` is set
    (checked once the model directory exists; a provider's model is checked by the engine at start-up)."""
    path = cfg.model.path
    if not (path / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    from rlstages.engines.rollout.chat_render import ChatRenderer, TemplateError
    from rlstages.engines.rollout.multi_turn import prefill_ids

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if cfg.data.chat_template:
        tokenizer.chat_template = cfg.data.chat_template
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    mt = cfg.rollout.multi_turn
    try:
        renderer = ChatRenderer(tokenizer, eos, cfg.data.system_prompt)
        preserving = renderer.prefix_preserving()
    except TemplateError as exc:
        raise PreflightError(f"rollout.multi_turn.enabled: {exc}") from None
    try:
        prefill_ids(renderer, mt.assistant_prefill, eos, mt.max_response_tokens)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    if not preserving and mt.template_not_prefix_preserving == "refuse":
        raise PreflightError(
            "rollout.multi_turn.template_not_prefix_preserving: the chat template of "
            f"{path} rewrites earlier turns; expected 'new_row' to train on it (a new row per turn)"
        )


def check_data_rows(cfg: RunConfig) -> None:
    """Both splits read and checked row by row: the file, row and column of a bad cell are named."""
    from rlstages.tasks.data import check_data

    check_data(cfg)


def check_images(cfg: RunConfig) -> None:
    """Image rows: each opens, placeholders match, within the image and length limits, a VLM with its processor."""
    from rlstages.tasks.data import load_rows
    from rlstages.tasks.vision_data import check_image_rows

    check_image_rows(cfg, [r for split in ("train", "eval") for r in load_rows(cfg.data, split)])


def check_run_dir(cfg: RunConfig) -> list[str] | None:
    """The run directory: one of another config is refused unless it holds nothing committed (then the run
    starts over in it, said as a warning); a continued run's newest checkpoint must be intact."""
    if cfg.checkpoint.resume == "fresh":
        return None  # a new directory per flow run
    from rlstages.tasks.run_dir import resolve_run_dir, starts_over

    path = resolve_run_dir(cfg)
    if starts_over(cfg, path):
        return [f"{path} holds a run that committed nothing (no checkpoint, no final policy); it starts over there"]
    if (path / "config.yaml").is_file():  # the run continues: its newest checkpoint must be sound
        from rlstages.tasks.checkpoint import latest_checkpoint
        from rlstages.tasks.context import RunHandle

        latest_checkpoint(RunHandle(path.name, str(path)), verify=True, on_corrupt=cfg.checkpoint.on_corrupt)
    return None


def check_backend_packages(cfg: RunConfig) -> None:
    """Every chosen backend's package is installed here (when the workers run here)."""
    from rlstages.tasks.workers import missing_backend_package

    problem = missing_backend_package(cfg)
    if problem:
        raise PreflightError(problem)


# The pre-flight, in order: cheap checks of the config and the files first, then what imports or reads more.
CHECKS: tuple[Check, ...] = (
    check_run_name,
    check_faults,
    check_models,
    check_data_files,
    check_imports,
    check_tracking_store,
    check_lora_targets,
    check_tool_isolation,
    check_multi_turn,
    check_context_parallel,
    check_prompt_lengths,
    check_data_rows,
    check_images,
    check_run_dir,
    check_backend_packages,
    check_cluster_resources,
)
