"""Ahead-of-time compilation of Triton kernels for GPUs that are not here.

``triton.compile`` with a ``GPUTarget`` needs no driver and no device: ptxas ships in the triton
wheel and the AMD linker is built into it, so every stage down to cubin/hsaco runs on a CPU. Tests
read the assembly texts to check that a kernel lowers to the instructions its arch should use.

Where the interpreter is on (``TRITON_INTERPRET=1``), ``@triton.jit`` returns interpreted
functions, which the compiler cannot take; :func:`compilable` rebuilds the real ``JITFunction``
of a kernel and of every jitted helper it reaches through its globals.
"""

from __future__ import annotations

import types
from typing import Any, Iterable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "sm_100": GPUTarget("cuda", 100, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}

TEXT_STAGES = ("ttir", "ttgir", "llir", "ptx", "amdgcn")

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # a triton without the interpreter
    InterpretedFunction = ()


def compilable(kernel: Any, _done: dict[int, JITFunction] | None = None) -> JITFunction:
    """``kernel`` as a ``JITFunction``, with interpreted helpers in its globals made real too."""
    if isinstance(kernel, JITFunction) and not _uses_interpreted(kernel.fn):
        return kernel
    if not isinstance(kernel, (JITFunction, InterpretedFunction)):
        raise TypeError(f"{kernel!r} is not a @triton.jit function")
    done = {} if _done is None else _done
    if id(kernel) in done:
        return done[id(kernel)]
    kwargs = getattr(kernel, "kwargs", None) or {}
    jit = JITFunction(kernel.fn, **kwargs)
    done[id(kernel)] = jit
    scope = dict(kernel.fn.__globals__)
    for name, value in scope.items():
        if isinstance(value, (JITFunction, InterpretedFunction)) and value is not kernel:
            scope[name] = compilable(value, done)
    jit.__globals__ = scope
    return jit


def _uses_interpreted(fn: types.FunctionType) -> bool:
    return bool(InterpretedFunction) and any(isinstance(v, InterpretedFunction) for v in fn.__globals__.values())


def compile_asm(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], target: str,
                num_warps: int = 4, num_stages: int | None = None,
                divisible_by_16: Iterable[str] = ()) -> dict[str, str]:
    """The text stages (ttir, ttgir, llir, then ptx or amdgcn) of ``kernel`` compiled for ``target``.

    ``signature`` types every runtime argument (``"*fp16"``, ``"i32"``, ...); ``constexprs`` gives
    the compile-time ones. Pointers are taken as 16-byte aligned, as torch allocations are when the
    JIT specializes a launch; integers named in ``divisible_by_16`` get the same hint.
    """
    fn = compilable(kernel)
    aligned = set(divisible_by_16)
    unknown = aligned - set(signature)
    if unknown:
        raise ValueError(f"divisible_by_16 names arguments not in the signature: {sorted(unknown)}")
    full = {**signature, **{name: "constexpr" for name in constexprs}}
    missing = [name for name in fn.arg_names if name not in full]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constexpr value for {missing}")
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, ty in signature.items() if ty.startswith("*") or name in aligned}
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    src = ASTSource(fn=fn, signature=full, constexprs=dict(constexprs), attrs=attrs)
    compiled = triton.compile(src, target=TARGETS[target], options=options)
    return {stage: text for stage, text in compiled.asm.items() if stage in TEXT_STAGES}
