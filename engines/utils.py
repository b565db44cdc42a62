"""Small helpers every part of `engines/` shares, defined once: a free port, import by "module:Name" (the
one importer of such strings, with its one error type),
an atomic text write and the dtype table.

Non-goal: anything that knows about models, batches or Ray.
"""

from __future__ import annotations

import importlib
import os
import socket
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name ("float32", "bfloat16", "float16")."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ImportTargetError(ImportError, ValueError):
    """A "package.module:attr" that cannot be imported; one line that starts with the config field naming it.

    Both an ImportError and a ValueError: the pre-flight refuses it as bad input like any other ValueError."""


def import_object(target: str, field: str | None = None, expected: str = "Name") -> Any:
    """Import `package.module:attr[.attr]` (the one importer of such strings: registries, backends, plugins).

    Raises ImportTargetError, one line starting with `field` (else the target itself), when the string is not
    `package.module:<expected>`, its module fails to import (whatever it raised) or lacks the attribute."""
    where = field or repr(target)
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ImportTargetError(f"{where}: expected 'package.module:{expected}', got {target!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raised while importing
        detail = str(err).splitlines()[0] if str(err) else ""
        raise ImportTargetError(
            f"{where}: cannot import module {module_name!r} ({type(err).__name__}: {detail})"
        ) from None
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ImportTargetError(f"{where}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    return obj


def atomic_write_text(path: Path, text: str) -> None:
    """Write text via a temp file, fsync and rename: readers see the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
