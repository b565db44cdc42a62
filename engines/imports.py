"""The one importer of "package.module:attr" strings (registries, backends, plugins, users' classes), torch-free so
that the tools and rewards registries load on a machine without torch."""

from __future__ import annotations

import importlib
from typing import Any


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
