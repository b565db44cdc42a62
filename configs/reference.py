"""Generate the config reference (markdown) from the pydantic schema: `python -m rlstages.configs.reference`.

The README's reference is this output, and a test keeps docs/config-reference.md in step with the code.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, get_args, get_origin

from pydantic import BaseModel

from rlstages.configs.run import RunConfig


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in get_args(annotation))
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models(a)]


def _default(field: Any) -> str:
    if field.is_required():
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`"


def render(model: type[BaseModel] = RunConfig, prefix: str = "", seen: set[str] | None = None) -> list[str]:
    """Markdown tables, one per section, in schema order."""
    seen = set() if seen is None else seen
    lines = [
        f"### `{prefix or 'top level'}` — {model.__name__}",
        "",
        (model.__doc__ or "").strip().splitlines()[0],
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        key = field.alias or name  # trainer.async (a Python keyword as a field name)
        lines.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        for sub in _models(field.annotation):
            nested.append((f"{prefix}{key}", sub))
    lines.append("")
    for path, sub in nested:
        key = f"{path}:{sub.__name__}"
        if key not in seen:
            seen.add(key)
            lines += render(sub, f"{path}.", seen)
    return lines


def main() -> None:
    """Print the reference."""
    header = [
        "# Config reference",
        "",
        "Generated from the schema by `python -m rlstages.configs.reference`; "
        "sections with several backends list each backend's options.",
        "",
    ]
    sys.stdout.write("\n".join(header + render()) + "\n")


if __name__ == "__main__":
    main()
