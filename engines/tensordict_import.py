"""`TensorDict`, imported without importing `torch._dynamo`.

At import, tensordict (0.15) marks a few of its functions for `torch.compile` through
`torch.compiler.allow_in_graph` and `assume_constant_result`, and each of those imports `torch._dynamo`: ~2 s of a
core (as long as `import torch` itself), paid by every process that imports tensordict: each Ray worker, each
`rlstages run`. Nothing of ours compiles TensorDict code (the compiled functions take plain tensors), so the two
markings are recorded during the import and applied by `register_with_dynamo()`, which every `torch.compile` site
of rlstages calls first. Both torch functions return the function they are given, so the deferred marking is the
same marking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.compiler

_DEFERRED = ("allow_in_graph", "assume_constant_result")
_marked: list[tuple[str, Any]] = []


def _recorder(name: str) -> Callable[[Any], Any]:
    def record(fn: Any) -> Any:
        _marked.append((name, fn))
        return fn

    return record


def _import_tensordict() -> None:
    """Import tensordict with the two markings recorded instead of applied (torch's own put back after)."""
    saved = {name: getattr(torch.compiler, name) for name in _DEFERRED}
    try:
        for name in _DEFERRED:
            setattr(torch.compiler, name, _recorder(name))
        import tensordict  # noqa: F401
    finally:
        for name, fn in saved.items():
            setattr(torch.compiler, name, fn)


def register_with_dynamo() -> None:
    """Apply tensordict's deferred `torch.compile` markings (imports torch._dynamo); call before `torch.compile`."""
    while _marked:
        name, fn = _marked.pop()
        getattr(torch.compiler, name)(fn)


_import_tensordict()

from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402  # after the import above

__all__ = ["NonTensorData", "NonTensorStack", "TensorDict", "register_with_dynamo"]
