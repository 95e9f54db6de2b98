"""What one decode step launches, counted on the CPU: the Triton kernels by name and the torch ops
that would each be a device kernel, by op and by the source line that issues them.

A decode step of a small model in a CUDA graph is launch-bound (each kernel costs a few
microseconds however little it does), so the count is what to cut. The engine runs the checkpoint
in fp32 or bf16 on the CPU with every family on its Triton backend, the kernels in the Triton
interpreter (a test plugin's trick: the Triton descriptors are offered on the CPU), the linear
backend picking its kernels as on a GPU (the GEMV for a decode row); after a prefill and one
decode step, the next decode step is counted. Views, allocations and casts to the
dtype a tensor already has launch nothing and are left out, as is what the interpreter does
inside a kernel.

    python benchmarks/decode_launches.py DIR [DIR ...] --json benchmarks/results/decode-launches-cpu.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import engine  # noqa: E402
from engine.backends.triton.descriptors import triton_descriptors  # noqa: E402
from engine.backends.triton.linear import TritonLinear  # noqa: E402
from engine.core.config import EngineConfig  # noqa: E402
from engine.core.engine import LLMEngine  # noqa: E402
from engine.core.hookspecs import hookimpl  # noqa: E402
from engine.core.plugins import load_plugins  # noqa: E402
from engine.core.registry import Descriptor  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402

try:
    from common import commit
except ImportError:
    from benchmarks.common import commit

FAMILIES = ("attention", "v4_attention", "mhc", "moe", "linear", "norm")
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "permute", "unsqueeze", "squeeze",
             "as_strided", "detach", "detach_", "alias", "transpose", "split", "split_with_sizes", "unbind", "chunk",
             "narrow", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "unflatten", "flatten", "_reshape_alias",
             "view_as", "movedim", "diagonal", "promote_types", "resolve_conj", "resolve_neg", "_local_scalar_dense"}
ROOT = str(Path(engine.__file__).parent) + os.sep  # as frames name the package, through any symlink


class GPULinear(TritonLinear):
    """The Triton linear backend choosing its kernels as on a GPU: the GEMV (and the norms and
    activations it fuses) serves a decode row on the CPU too, interpreted."""

    gemv_devices = ("cuda", "cpu")


def interpreted_triton() -> types.ModuleType:
    """A plugin offering each family's Triton backend on the CPU (its kernels then run interpreted)."""
    module = types.ModuleType("interpreted_triton")
    for family in FAMILIES:
        (d,) = triton_descriptors(family, "nvidia")
        create = GPULinear if family == "linear" else d.create
        hook = f"engine_register_{family}_backends"
        setattr(module, hook, hookimpl(specname=hook)(lambda d=d, c=create: [Descriptor(d.family, d.name, c)]))
    return module


class Launches(TorchDispatchMode):
    """Counts torch ops that launch a kernel, and Triton launches, outside the interpreter's own work."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[str] = collections.Counter()
        self.triton: collections.Counter[str] = collections.Counter()
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self._inside or name in NO_KERNEL or (name == "to" and out is args[0]):
            return out
        self.ops[name] += 1
        frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                      if f.filename.startswith(ROOT) and os.sep + "." not in f.filename[len(ROOT) - 1:]
                      and not f.filename.endswith("decode_launches.py")), None)
        if frame is not None:
            self.lines[f"{frame.filename[len(ROOT):]}:{frame.lineno} {name}"] += 1
        return out

    def __enter__(self):
        run = interpreter.InterpretedFunction.run

        def counted(fn, *args, **kwargs):
            self.triton[fn.fn.__name__] += 1
            self._inside += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._inside -= 1

        self._run, interpreter.InterpretedFunction.run = run, counted
        return super().__enter__()

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = self._run
        return super().__exit__(*exc)


def count(model: Path, dtype: str) -> dict:
    hf = json.loads((model / "config.json").read_text())
    v4 = hf.get("model_type") == "deepseek_v4"
    families = ["v4_attention", "mhc", "moe", "linear", "norm"] if v4 else ["attention", "linear", "norm"] + (
        ["moe"] if hf.get("num_experts") else [])
    config = EngineConfig(model=str(model), dtype=dtype, device="cpu", page_size=16, num_pages=64,
                          **{f"{f}_backend": "triton" for f in families})
    engine = LLMEngine(config, plugins=load_plugins(extra=[interpreted_triton()]), progress=False)
    engine.add_request("0", list(range(10, 40)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prompt
    engine.step()  # the first decode step
    with Launches() as launches:
        engine.step()
    kernels = sum(launches.triton.values()) + sum(launches.ops.values())
    return {"model": model.name, "dtype": dtype, "families": {f: "triton" for f in families},
            "kernels": kernels, "triton": sum(launches.triton.values()), "torch": sum(launches.ops.values()),
            "triton_by_kernel": dict(launches.triton.most_common()), "torch_by_op": dict(launches.ops.most_common()),
            "torch_by_line": dict(launches.lines.most_common(40))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cases = []
    for model in args.models:
        case = count(model, args.dtype)
        cases.append(case)
        print(f"{case['model']}: {case['kernels']} launches a decode step = {case['triton']} Triton kernels + "
              f"{case['torch']} torch ops; " + ", ".join(f"{k} x{v}" for k, v in list(case["torch_by_op"].items())[:8]))
    if args.json:
        result = {"benchmark": "decode_launches", "device": "cpu (Triton interpreter)", "commit": commit(),
                  "command": "python " + " ".join(sys.argv), "cases": cases}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
