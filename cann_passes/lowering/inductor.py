"""inductor: torch's own compiler (``compile_fx``), C++/OpenMP on CPU, Triton on GPU.

The graph is already functional aten, so inductor's own AOT step has nothing
left to trace and goes straight to fusion and code generation.
"""
from __future__ import annotations

from graph_ir import TrainGraph

from .base import cxx_compiler_available


class InductorLowering:
    name = "inductor"

    def available(self) -> tuple[bool, str]:
        return cxx_compiler_available()

    def compile(self, graph: TrainGraph, example_inputs, plan):
        from torch._inductor.compile_fx import compile_fx
        graph.recompile()
        return compile_fx(graph.gm, list(example_inputs))
