"""The decoder layers' element-wise work (RMSNorm, SwiGLU, rotary embedding) through `torch.compile` while training.

Issue 41's profile of the GRPO update on a Qwen2-1.5B shape (H200) put half of the kernels' time outside the GEMMs:
transformers' float32 RMSNorm (upcast, square, mean, rsqrt, two products, the cast back: PowBackward,
MulBackward, `copy_`), SwiGLU and the rotary embedding (slices, a `cat`, four products and two sums per call),
each a memory-bound kernel of its own, forward and backward. Compiled, each of the three is one or two fused
kernels. The fused functions below are the same math as transformers' Llama/Qwen-family modules, and
`fuse_elementwise` routes a model's modules to them only where a module's code is that math (its source,
compared with transformers' Llama reference), so any other family keeps its own code.

Only tensors on `KERNELS.devices` with autograd recording take the compiled path: the trainer's forward and
backward on a GPU. Elsewhere (the CPU, where compiling costs seconds per shape) a routed RMSNorm or MLP that
records autograd runs `lean_layers`' eager functions: the same outputs, less kept for the backward. Generation
and the no-grad log-prob passes keep transformers' code. A function that does not compile falls back to the
eager code, with a warning.
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlstages.engines.compiled import CompiledFunctions
from rlstages.engines.models import lean_layers

log = logging.getLogger(__name__)

_ORIGINAL = "_rlstages_original"  # the attribute the routed rotary function keeps transformers' one under


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama/Qwen RMSNorm: normalise in float32 by the root mean square of the last dim, cast back, scale."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gate: silu(gate) * up."""
    return torch.nn.functional.silu(gate) * up


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """The rotary embedding of queries and keys (rotate-half layout), as transformers' `apply_rotary_pos_emb`."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    def rotate_half(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# bench/bench_gpu.py turns `KERNELS.enabled` off to time transformers' own kernels; tests add "cpu" to its devices
KERNELS = CompiledFunctions({"rms_norm": rms_norm, "swiglu": swiglu, "rotary": rotary}, "fused decoder kernel")


def active(t: Tensor) -> bool:
    """Whether a call on `t` takes the compiled path: `KERNELS` takes `t` and autograd is recording (training)."""
    return torch.is_grad_enabled() and KERNELS.takes(t)


def lean(t: Tensor) -> bool:
    """Whether a call on `t` takes `lean_layers`' eager path: autograd is recording on a device the compiled set is
    not for (the CPU). Where it is for one and a function does not compile, transformers' code runs, as without
    routing."""
    return torch.is_grad_enabled() and t.device.type not in KERNELS.devices


def probe(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Compile each function once, forward and backward, on small inputs of `device` and `dtype`, so that a
    compiler failing only in the backward (which `KERNELS.run` cannot catch: it raises in `loss.backward()`) marks the
    function failed before training; returns the functions that work. Shapes stay dynamic after this."""

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    x, w = rand(2, 3, 8), torch.ones(8, device=device, dtype=dtype)
    q, k, cos, sin = rand(2, 4, 3, 8), rand(2, 2, 3, 8), rand(2, 3, 8), rand(2, 3, 8)
    cases = {"rms_norm": (x, w, 1e-6), "swiglu": (x, x.clone()), "rotary": (q, k, cos, sin, 1)}
    for name, args in cases.items():
        leaves = [a.clone().requires_grad_(True) if isinstance(a, Tensor) else a for a in args]
        out = KERNELS.run(name, *leaves)
        if out is None:
            continue
        try:
            sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
        except Exception as exc:  # noqa: BLE001 - the backward did not compile: transformers' code for this one
            KERNELS.mark_failed(name, exc)
    return [name for name in cases if name not in KERNELS.failed]


def plain_function(fn: Any) -> Any:
    """The Python function behind `fn`: itself, or the one a `kernels` hub wrapper calls (transformers 5.25 with
    `kernels` installed makes `apply_rotary_pos_emb` such an `nn.Module`, whose own source cannot be read)."""
    if not isinstance(fn, torch.nn.Module):
        return fn
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars:
        return fn
    inner = forward.__closure__[code.co_freevars.index("func")].cell_contents  # type: ignore[union-attr]
    return inner if inspect.isfunction(inner) else fn


def _body(fn: Callable[..., Any]) -> str:
    """A function's code without its docstring, decorators and name: what two copies of the same math share."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(plain_function(fn))))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return "\n".join(ast.dump(stmt) for stmt in body)


def _reference() -> dict[str, str]:
    """The code of transformers' Llama RMSNorm and MLP forwards and its rotary functions (the math above)."""
    from transformers.models.llama import modeling_llama as m

    return {
        "norm": _body(m.LlamaRMSNorm.forward),
        "mlp": _body(m.LlamaMLP.forward),
        "rotary": _body(getattr(m.apply_rotary_pos_emb, _ORIGINAL, m.apply_rotary_pos_emb)),  # Llama's own, if routed
        "rotate_half": _body(m.rotate_half),
    }


def _same_code(fn: Any, ref: str) -> bool:
    """Whether `fn` is a Python function whose code is `ref` (False for builtins and code that has no source)."""
    try:
        return _body(fn) == ref
    except (OSError, TypeError, SyntaxError):
        return False


def fused_norm_forward(self: Any, hidden_states: Tensor) -> Tensor:
    """A routed RMSNorm's forward (bound to the module, so a deep copy binds to the copy): the compiled
    `rms_norm` while training on `KERNELS.devices`, `lean_layers.rms_norm` while training on other devices (the
    CPU), else its class's own forward."""
    if active(hidden_states):
        out = KERNELS.run("rms_norm", hidden_states, self.weight, self.variance_epsilon)
        if out is not None:
            return out
    if lean(hidden_states):
        return lean_layers.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def fused_mlp_forward(self: Any, x: Tensor) -> Tensor:
    """A routed SwiGLU MLP's forward: the projections as before, the gate through the compiled `swiglu` (training on
    `KERNELS.devices`) or `lean_layers.swiglu` (training on other devices)."""
    if active(x):
        gated = KERNELS.run("swiglu", self.gate_proj(x), self.up_proj(x))
        if gated is not None:
            return self.down_proj(gated)
    if lean(x):
        return self.down_proj(lean_layers.swiglu(self.gate_proj(x), self.up_proj(x)))
    return type(self).forward(self, x)


def _rotary_function(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Any:
        if active(q):
            out = KERNELS.run("rotary", q, k, cos, sin, unsqueeze_dim)
            if out is not None:
                return out
        return original(q, k, cos, sin, unsqueeze_dim)

    setattr(apply_rotary_pos_emb, _ORIGINAL, original)
    return apply_rotary_pos_emb


def _is_silu(act: Any) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, SiLUActivation | torch.nn.SiLU)


def _route_module(module: Any, ref: dict[str, str]) -> str | None:
    """Route one module's forward to its fused function where its code is the reference's; which one, or None."""
    routed = getattr(module.forward, "__func__", None)
    if routed is fused_norm_forward or routed is fused_mlp_forward:  # routed before
        return "rms_norm" if routed is fused_norm_forward else "swiglu"
    forward = type(module).forward
    if hasattr(module, "variance_epsilon") and _same_code(forward, ref["norm"]):
        module.forward = types.MethodType(fused_norm_forward, module)
        return "rms_norm"
    if hasattr(module, "gate_proj") and _is_silu(getattr(module, "act_fn", None)) and _same_code(forward, ref["mlp"]):
        module.forward = types.MethodType(fused_mlp_forward, module)
        return "swiglu"
    return None


def _calls_rotary(forward: Any) -> bool:
    """Whether an attention's forward calls its module's `apply_rotary_pos_emb` by name (what routing replaces);
    an attention that rotates its queries some other way keeps its own code and is not counted."""
    try:
        return "apply_rotary_pos_emb(" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def _route_rotary(modeling: Any, ref: dict[str, str]) -> bool:
    """Route a modeling module's `apply_rotary_pos_emb` (what its attention calls by name) to the fused function
    where its code and its `rotate_half`'s are the reference's; whether it is routed."""
    fn = getattr(modeling, "apply_rotary_pos_emb", None)
    if fn is None or hasattr(fn, _ORIGINAL):
        return fn is not None
    if not (_same_code(fn, ref["rotary"]) and _same_code(getattr(modeling, "rotate_half", None), ref["rotate_half"])):
        return False
    modeling.apply_rotary_pos_emb = _rotary_function(fn)
    return True


def fuse_elementwise(model: torch.nn.Module) -> dict[str, int]:
    """Route `model`'s RMSNorm and SwiGLU MLP modules, and its attention's rotary function, to the compiled
    functions where their code is the Llama reference's; returns how many modules of each were routed.
    Idempotent."""
    ref = _reference()
    counts = {"rms_norm": 0, "swiglu": 0, "rotary": 0}
    attention: dict[str, int] = {}
    for module in model.modules():
        kind = _route_module(module, ref)
        if kind is not None:
            counts[kind] += 1
        if hasattr(module, "q_proj") and _calls_rotary(type(module).forward):
            name = type(module).__module__
            attention[name] = attention.get(name, 0) + 1
    for name, n in attention.items():
        if _route_rotary(sys.modules[name], ref):
            counts["rotary"] += n
    return counts
