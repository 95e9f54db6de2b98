"""Ahead-of-time compilation of Triton kernels for GPUs that are not here.

``triton.compile`` with a ``GPUTarget`` needs no driver and no device: ptxas ships in the triton
wheel and the AMD linker is built into it, so every stage down to cubin/hsaco runs on a CPU. Tests
read the assembly texts to check that a kernel lowers to the instructions its arch should use.

Under ``TRITON_INTERPRET=1`` (set for the CPU test session) ``@triton.jit`` makes interpreted
functions, triton's own ``tl.sum``/``tl.max``/... among them, and running one leaves
``triton.language`` patched for the interpreter for the rest of the process. Such kernels are
compiled in one worker process started with the interpreter off, which imports the kernel's
module afresh: the compiler sees the same ``JITFunction`` a GPU run would.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Iterable

import triton
import triton.backends.nvidia as nvidia_backend
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
LDS_BYTES = {"gfx942": 64 << 10, "gfx950": 160 << 10}  # what one workgroup may take on CDNA3 / CDNA4
SHARED_BYTES = {"sm_90": 227 << 10, "sm_100": 227 << 10}  # what one block may take on Hopper / Blackwell

_worker: ProcessPoolExecutor | None = None


def compile_asm(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], target: str,
                num_warps: int = 4, num_stages: int | None = None,
                divisible_by_16: Iterable[str] = (), sass: bool = False, **options: Any) -> dict[str, str]:
    """The text stages (ttir, ttgir, llir, then ptx or amdgcn) of ``kernel`` compiled for ``target``,
    ``"shared"``: the bytes of shared memory (LDS) a program takes, in decimal, and with ``sass``
    on NVIDIA the machine code ptxas made of it (cuobjdump, shipped with triton).

    ``signature`` types every runtime argument (``"*fp16"``, ``"i32"``, ...); ``constexprs`` gives
    the compile-time ones. Pointers are taken as 16-byte aligned, as torch allocations are when the
    JIT specializes a launch; integers named in ``divisible_by_16`` get the same hint. Further
    keywords are compile options, as a launch takes them (``enable_fp_fusion=False``, ...).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {sorted(TARGETS)}")
    if not hasattr(kernel, "fn") or not hasattr(kernel, "arg_names"):
        raise TypeError(f"{kernel!r} is not a @triton.jit function")
    missing = [name for name in kernel.arg_names if name not in signature and name not in constexprs]
    unknown = (set(signature) | set(constexprs) | set(divisible_by_16)) - set(kernel.arg_names)
    if missing or unknown:
        raise ValueError(f"{kernel.fn.__name__}: no type or constexpr value for {missing}; "
                         f"not arguments: {sorted(unknown)}")
    options = {"num_warps": num_warps, **options}
    if num_stages is not None:
        options["num_stages"] = num_stages
    job = (signature, dict(constexprs), target, options, tuple(divisible_by_16), sass)
    if isinstance(kernel, JITFunction):
        return _compile(kernel, *job)
    return _interpreter_free_worker().submit(_compile_by_name, kernel.fn.__module__, kernel.fn.__qualname__,
                                             *job).result()


def amdgcn_target(amdgcn: str) -> str:
    """The ``.amdgcn_target`` an AMD assembly text was built for (it names the gfx arch)."""
    return next(line for line in amdgcn.splitlines() if ".amdgcn_target" in line)


def _compile(fn: JITFunction, signature, constexprs, target, options, divisible_by_16, sass=False):
    full = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, ty in signature.items() if ty.startswith("*") or name in divisible_by_16}
    compiled = triton.compile(ASTSource(fn=fn, signature=full, constexprs=constexprs, attrs=attrs),
                              target=TARGETS[target], options=options)
    out = {stage: text for stage, text in compiled.asm.items() if stage in TEXT_STAGES}
    out["shared"] = str(compiled.metadata.shared)
    if sass:
        out["sass"] = _disassemble(compiled.asm["cubin"])
    return out


def _disassemble(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def local_memory_ops(sass: str) -> int:
    """Loads and stores to local memory in a SASS listing: register spills, in a kernel that indexes
    no local array."""
    return len(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(?:STL|LDL)\b", sass, re.M))


def amd_scratch_and_lds(asm: dict[str, str]) -> tuple[int, int]:
    """(scratch, LDS) bytes a program of an AMD build takes: scratch is what spilled registers need."""
    return int(re.search(r"; ScratchSize: (\d+)", asm["amdgcn"]).group(1)), int(asm["shared"])


def assert_no_spills(asm: dict[str, str], target: str) -> None:
    """No local memory in an NVIDIA build (compiled with ``sass``), no scratch and LDS within a
    workgroup's in an AMD one."""
    if target.startswith("sm_"):
        assert local_memory_ops(asm["sass"]) == 0
    else:
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]


def _compile_by_name(module: str, qualname: str, *job) -> dict[str, str]:
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    try:
        return _compile(fn, *job)
    except Exception as e:  # compiler errors hold unpicklable IR: send the message back
        raise RuntimeError(f"{type(e).__name__}: {e}") from None


def _interpreter_free_worker() -> ProcessPoolExecutor:
    """One spawned process for the session, started with ``TRITON_INTERPRET`` unset."""
    global _worker
    if _worker is None:
        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            _worker = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            _worker.submit(sys.path.copy).result()  # starts the process while the variable is unset
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved
    return _worker


GRID_DEPENDENCY = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")  # what PDL compiles to


def pdl(target: str) -> bool:
    """A decode kernel's ``PDL`` constexpr as its launch sets it: on NVIDIA (sm_90 and later) only."""
    return target.startswith("sm_")
