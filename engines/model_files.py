"""The files of an HF model directory, checked without loading them (torch-free): a config.json that is an HF
config, and safetensors weights whose headers are whole. The pre-flight checks `model.path` with it before
anything starts; the reward model engine checks its directory with it before loading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelDirError(ValueError):
    """A model directory that cannot be loaded; one line starting with the field naming it."""


def check_model_dir(path: Path, field: str, required: bool = True) -> None:
    """An HF directory: config.json parses as an object, and every *.safetensors has a complete header.

    A missing directory is a FileNotFoundError (unless not `required`: a provider builds it on first use);
    anything else wrong is a ModelDirError. Both are one line starting with `field`."""
    if not path.exists():
        if required:
            raise FileNotFoundError(f"{field}: {path} does not exist (expected an HF model directory)")
        return  # a provider builds it on first use
    if not path.is_dir():
        raise ModelDirError(f"{field}: {path} is not a directory (expected an HF model directory)")
    config = path / "config.json"
    if not config.is_file():
        if not required and not any(path.iterdir()):
            return
        raise ModelDirError(f"{field}: {path} has no config.json ({config} is missing: expected the model's HF config)")
    raw = _read_json(config, field)
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type", ""), str):
        raise ModelDirError(f"{field}: {config} is not an HF config (expected a JSON object with model_type)")
    weights = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        mapping = _read_json(index, field).get("weight_map", {})
        for name in sorted(set(mapping.values()) if isinstance(mapping, dict) else ()):
            if not (path / name).is_file():
                raise ModelDirError(f"{field}: {path / name} is named in {index.name} but missing")
    if not weights and not any(path.glob("*.gguf")):
        raise ModelDirError(f"{field}: {path} has no *.safetensors weights")
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
        raise ModelDirError(f"{field}: {file} is not a readable safetensors file ({exc})") from None
    if 8 + length + end > size:
        raise ModelDirError(
            f"{field}: {file} is truncated ({size} bytes, its header needs {8 + length + end}); copy it again"
        )


def _read_json(path: Path, field: str) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"{field}: {path} is not valid JSON ({type(exc).__name__}: {exc})") from None
