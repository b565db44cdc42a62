"""Load a RunConfig from YAML plus dotted command-line overrides, and report errors in one line."""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from rlstages.configs.megatron_training import MEGATRON_ONLY, MegatronTrainingConfig
from rlstages.configs.run import RunConfig
from rlstages.configs.training import TrainingConfig

_TAGS = ("backend", "kind")


class ConfigError(ValueError):
    """A config that cannot be loaded; the message names the file or field and what was expected."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into a path and a YAML-typed value (`8` -> int, `[1,2]` -> list, `x` -> str)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. actor.optim.lr=1e-6")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not key.strip():
        raise ConfigError(f"override {text!r}: empty key")
    if any(not p.strip() for p in path):
        raise ConfigError(f"override {text!r}: empty segment in {key.strip()!r}; expected dotted names like a.b.c")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set `value` at `path` in a nested dict/list tree, creating dicts on the way."""
    node: Any = tree
    for i, key in enumerate(path[:-1]):
        if isinstance(node, list):
            node = node[_index(path, i, node)]
            continue
        nxt = node.get(key)
        if not isinstance(nxt, dict | list):
            nxt = {}
            node[key] = nxt
        node = nxt
    last = path[-1]
    if isinstance(node, list):
        node[_index(path, len(path) - 1, node)] = value
    else:
        node[last] = value


def _index(path: list[str], i: int, node: list[Any]) -> int:
    key = path[i]
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(f"override {'.'.join(path)}: {key!r} is not an index of a list of {len(node)}")
    return int(key)


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, with a one-line error naming the file when it is missing or malformed."""
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a YAML file")
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top, got {type(data).__name__}")
    return data


def build_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a raw dict as a RunConfig, turning the first pydantic error into a one-line ConfigError."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc, data)}") from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load YAML, apply `a.b=value` overrides (typed by the schema), validate everything once."""
    path = Path(path)
    data = read_yaml(path)
    for text in overrides:
        apply_override(data, *parse_override(text))
    return build_config(data, str(path))


def format_validation_error(exc: ValidationError, data: dict[str, Any]) -> str:
    """One line: the dotted field path (union tags removed) and what was expected (each member's expectation
    where a scalar matched none of a union's members, e.g. `bool | "auto"`)."""
    errors = exc.errors()
    err = errors[0]
    loc = _strip_tags(list(err["loc"]), data)
    members = _union_members(errors, loc, data)
    if members:
        loc = loc[:-1]
        errors = [e for e in errors if e not in members[1:]]
    field = ".".join(str(p) for p in loc)
    msg = err["msg"]
    if members:
        msg += "".join(f", or {m['msg'].removeprefix('Input should be ')}" for m in members[1:])
    if err["type"] == "extra_forbidden":
        msg = _megatron_only(err["loc"], loc) or f"unknown key (not in the schema){_did_you_mean(err['loc'])}"
    elif err["type"] == "missing":
        msg = "required field is missing"
    elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {err['input']!r})"
    msg = msg.removeprefix("Value error, ")
    extra = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{field}: {msg}{extra}" if field else f"{msg}{extra}"


# the `backend` tag of each training options class (the union's members)
TRAINING_TAGS = {cls.model_fields["backend"].default for cls in get_args(get_args(TrainingConfig)[0])}


def _megatron_only(raw_loc: tuple[Any, ...], loc: list[Any]) -> str | None:
    """For a key only the megatron backend reads, given to a torch / deepspeed training section: what it needs
    (`expert parallelism needs actor.backend=megatron`), else None."""
    if len(raw_loc) < 2 or raw_loc[-2] not in TRAINING_TAGS or len(loc) < 2:
        return None
    key = str(loc[-1])
    if key not in MegatronTrainingConfig.model_fields:
        return None
    what = MEGATRON_ONLY.get(key, f"{key}, a megatron option,")
    section = ".".join(str(p) for p in loc[:-1])
    return f"{what} needs {section}.backend=megatron (this section's backend is {raw_loc[-2]})"


def _did_you_mean(raw_loc: tuple[Any, ...]) -> str:
    """`; did you mean total_steps?` where an unknown key is a likely misspelling of one its section has."""
    key = raw_loc[-1] if raw_loc else None
    if not isinstance(key, str):
        return ""
    names = sorted({name for model in _models_at(raw_loc[:-1]) for name in model.model_fields})
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.72)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _models_at(loc: tuple[Any, ...]) -> list[type[BaseModel]]:
    """The schema's model classes a pydantic error location points into (a union's members where it is one)."""
    models: list[type[BaseModel]] = [RunConfig]
    for part in loc:
        if isinstance(part, int):  # a list's item: its models are the list's
            continue
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if fields:
            models = [c for f in fields for c in _model_classes(f.annotation)]
        else:  # a union member's tag (`torch`) or pydantic's own segment (`function-after[...]`)
            tagged = [m for m in models if any(m.model_fields[t].default == part for t in _TAGS if t in m.model_fields)]
            models = tagged or models
    return models


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models in a field's annotation (through Optional, unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [c for arg in get_args(annotation) for c in _model_classes(arg)]


def _union_members(errors: list[Any], loc: list[Any], data: Any) -> list[Any]:
    """The errors of each member of a plain union that a scalar input matched none of (their locations end in
    the member's name, e.g. `bool`, `literal['auto']`), the first error's among them; [] for any other error."""
    node: Any = data
    for part in loc[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if len(loc) < 2 or isinstance(node, dict | list) or node is None:
        return []
    same = [e for e in errors if _strip_tags(list(e["loc"]), data)[:-1] == loc[:-1]]
    return same if len(same) > 1 else []


def _strip_tags(loc: list[Any], data: Any) -> list[Any]:
    out: list[Any] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part not in node and any(node.get(t) == part for t in _TAGS):
            continue
        if isinstance(part, str) and part.startswith("function-") or part in ("tagged-union",):
            continue
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return out


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Flatten a config dump to `a.b.c -> str(value)` (MLflow params)."""
    out: dict[str, str] = {}
    if isinstance(tree, dict):
        for key, val in tree.items():
            out.update(flatten(val, f"{prefix}{key}."))
    elif isinstance(tree, list | tuple) and tree and all(isinstance(v, dict) for v in tree):
        for i, val in enumerate(tree):
            out.update(flatten(val, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = json.dumps(tree) if isinstance(tree, list | tuple) else str(tree)
    return out


# Where a run lives and how it starts do not change what it computes: left out of the hash, so a run
# resumed from another working directory (absolute paths) is recognised as the same run.
_NOT_HASHED = {  # profile, step_cost_shape: observe only; checkpoint_on_signal: when a stopped run commits;
    # commit_in_background: when a checkpoint's commit runs, not what it holds
    "trainer": {"output_dir", "run_name", "profile", "checkpoint_on_signal", "step_cost_shape"},
    "checkpoint": {"resume", "commit_in_background"},
}


def config_hash(cfg: RunConfig) -> str:
    """A short, stable digest of what the run computes (canonical JSON; location and start mode excluded;
    fields at their defaults left out, so a new release's new defaulted field keeps old runs resumable).
    Union tags (`backend`, `kind`) are always in: they are defaults of their own classes, yet choose the engine."""
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    _keep_tags(cfg.model_dump(mode="json"), data)
    for section, keys in _NOT_HASHED.items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    blob = json.dumps(data, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _keep_tags(full: Any, sparse: dict[str, Any]) -> None:
    """Copy every `backend`/`kind` of the full dump into the sparse one (creating the sections on the way)."""
    if not isinstance(full, dict):
        return
    for key, value in full.items():
        if key in _TAGS and isinstance(value, str):
            sparse[key] = value
        elif isinstance(value, dict) and _has_tag(value):
            node = sparse.setdefault(key, {})
            if isinstance(node, dict):
                _keep_tags(value, node)


def _has_tag(tree: Any) -> bool:
    return isinstance(tree, dict) and any(k in _TAGS or _has_tag(v) for k, v in tree.items())


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what `config show` prints and MLflow stores)."""
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
