"""eager: run the FX graph op by op with PyTorch's own kernels.

The reference backend: no compilation, so every other backend is checked
against it, and the one that runs anywhere torch runs.
"""
from __future__ import annotations

from graph_ir import TrainGraph


class EagerLowering:
    name = "eager"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def compile(self, graph: TrainGraph, example_inputs, plan):
        graph.recompile()
        return graph.gm
