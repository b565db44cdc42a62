"""The one importer of "package.module:attr" strings (registries, backends, plugins, users' classes) and the one
allow-list rule of a deployment (`rlstages deploy --allow-import`), torch-free so that the tools and rewards
registries and the pre-flight load on a machine without torch."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

ALLOWED_IMPORTS_ENV = "RLSTAGES_ALLOWED_IMPORTS"  # set by `rlstages deploy`; a run's parameters cannot change it


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


def allowed_imports() -> tuple[str, ...] | None:
    """The deployment's allow-list (set by `rlstages deploy --allow-import`), or None outside deployments."""
    raw = os.environ.get(ALLOWED_IMPORTS_ENV)
    if raw is None:
        return None
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def check_allowed(targets: Iterable[tuple[str, str]], allowed: tuple[str, ...] | None) -> None:
    """The one allow-list rule: each (field, module) is allowed when the module or a package above it is on
    `allowed` (no list: everything is). Raises ImportTargetError, one line naming the field, for the first that
    is not."""
    if allowed is None:
        return
    for field, module in targets:
        if not any(module == a or module.startswith(f"{a}.") for a in allowed):
            raise ImportTargetError(
                f"{field}: module {module!r} is not on this deployment's import allow-list "
                f"({', '.join(allowed) or 'empty'}); redeploy with --allow-import {module}"
            )
