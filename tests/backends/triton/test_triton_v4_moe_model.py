"""tiny-dsv4-py with every family on its Triton backend (the MoE's decode steps through the one-launch
dispatch, with the router's GEMV in it once one sequence is left, its prefill chunks routing and
aligning apart; a decode step's attention input and query projections chained in one launch and its
output projection's two halves in one, as on a GPU) greedy-identical to the native families, in the
interpreter, in fp32: two prompts of random lengths decoded together, then the second alone, their
hash layers routed by token id.

The Triton descriptors refuse a CPU, so a test plugin offers them under the same names on it.
"""

from __future__ import annotations

import random
import types

import pytest

from engine.backends.triton import gemv_chain, low_rank_output
from engine.backends.triton import moe as triton_moe
from engine.backends.triton.descriptors import triton_descriptors
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.moe import TritonMoE
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.hookspecs import hookimpl
from engine.core.plugins import load_plugins
from engine.core.registry import Descriptor
from engine.core.sampling_params import SamplingParams

FAMILIES = ("v4_attention", "mhc", "moe", "linear", "norm")


class FusedDecodeLinear(TritonLinear):
    """The Triton linear backend taking a decode step's fused launches (the chained projections, the
    output projection's one launch) on the CPU too, as on a GPU; its single products stay F.linear,
    whose GEMVs the interpreter would take minutes over."""

    def projection_then_normed(self, *args):
        return self._as_on_a_gpu(super().projection_then_normed, *args)

    def low_rank_output(self, *args):
        return self._as_on_a_gpu(super().low_rank_output, *args)

    def _as_on_a_gpu(self, method, *args):
        self.gemv_devices = ("cuda", "cpu")
        try:
            return method(*args)
        finally:
            del self.gemv_devices


def interpreted_triton() -> types.ModuleType:
    module = types.ModuleType("interpreted_triton_families")
    for family in FAMILIES:
        (d,) = triton_descriptors(family, "nvidia")
        create = FusedDecodeLinear if family == "linear" else d.create
        hook = f"engine_register_{family}_backends"
        setattr(module, hook, hookimpl(specname=hook)(lambda d=d, c=create: [Descriptor(d.family, d.name, c)]))
    return module


@pytest.mark.interpret
def test_tiny_dsv4_on_the_triton_families_is_greedy_identical_to_native(seed, shared_dir, monkeypatch):
    rng = random.Random(seed)
    # the first prompt's prefill is over the 16 tokens one dispatch program takes on the CPU
    prompts = [[rng.randrange(10, 4096) for _ in range(rng.randint(lo, hi))] for lo, hi in ((17, 19), (1, 4))]
    dispatched = []
    route_experts = TritonMoE.route_experts

    def counted(self, x, *args, **kwargs):
        dispatched.append(x.shape[0])
        return route_experts(self, x, *args, **kwargs)

    monkeypatch.setattr(TritonMoE, "route_experts", counted)
    projected = []
    project = triton_moe.project_route_and_align

    def counted_projection(x, *args, **kwargs):
        projected.append(x.shape[0])
        return project(x, *args, **kwargs)

    monkeypatch.setattr(triton_moe, "project_route_and_align", counted_projection)
    fused = {"chain": [], "output": []}
    for name, module, fn in (("chain", gemv_chain, "gemv_chain"), ("output", low_rank_output, "low_rank_output")):
        launch = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, launch=launch, seen=fused[name]: seen.append(a[0].shape[0])
                            or launch(*a))
    tokens = []
    for name in ("native", "triton"):
        config = EngineConfig(model=str(shared_dir / "models" / "tiny-dsv4-py"), dtype="float32", device="cpu",
                              page_size=16, num_pages=16, **{f"{f}_backend": name for f in FAMILIES})
        engine = LLMEngine(config, plugins=load_plugins(extra=[interpreted_triton()]), progress=False)
        assert type(engine.components.model.model.layers[0].ffn.backend).__name__ == (
            "TritonMoE" if name == "triton" else "NativeMoE")
        for i, p in enumerate(prompts):  # a decode step of both, then one of the second alone (each costs a minute)
            engine.add_request(str(i), p, SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        tokens.append([outs[str(i)].outputs[0].token_ids for i in range(len(prompts))])
    assert tokens[1] == tokens[0]
    assert 2 in dispatched and max(dispatched) > 16  # decode steps of both prompts, and a prefill
    # one row only, and the step of the second prompt alone through every layer
    assert set(projected) == {1} and len(projected) >= len(engine.components.model.model.layers)
    # a decode step's projections in the fused launches (rows of 2 then 1), a prefill's apart
    assert all(set(rows) == {1, 2} for rows in fused.values())
