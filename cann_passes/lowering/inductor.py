"""inductor: torch's own compiler (``compile_fx``), C++/OpenMP on CPU, Triton on GPU.

The graph is already functional aten, so inductor's own AOT step has nothing
left to trace and goes straight to fusion and code generation.

The pipeline ends with the ``spell_out_alpha`` pass for this backend
(``required_passes``; the compile driver adds it to a pipeline given as text):
torch 2.13's post-grad ``addmm`` pattern drops the ``alpha`` of
``add(mm(a, b), c, alpha=k)``.
"""
from __future__ import annotations

from graph_ir import TrainGraph

from .base import cxx_compiler_available


class InductorLowering:
    name = "inductor"
    required_passes = ("spell_out_alpha",)

    def available(self) -> tuple[bool, str]:
        return cxx_compiler_available()

    def compile(self, graph: TrainGraph, example_inputs, plan):
        from torch._inductor.compile_fx import compile_fx
        gm = graph.copy().gm
        for node in gm.graph.nodes:
            # torch reads node.meta["recompute"] as a CheckpointPolicy (FX's code printer takes
            # its .name); the recompute pass's mark there is a plain bool, so the copy drops it.
            if isinstance(node.meta.get("recompute"), bool):
                del node.meta["recompute"]
        return compile_fx(gm, list(example_inputs))
