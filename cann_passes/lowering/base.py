"""The lowering interface and what every backend shares.

A lowering turns a final TrainGraph into a callable ``run(*flat_inputs) ->
list of outputs`` in the graph's signature order. The backends are chosen by
name in :mod:`cann_passes.lowering.registry`.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from collections import Counter
from typing import Any, Callable, Protocol

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.updates import updated_inputs

Runner = Callable[..., Any]


class BackendUnavailable(RuntimeError):
    pass


class LoweringFailed(RuntimeError):
    """A backend's compiler failed on a graph the passes produced and verified: the error names
    the backend, the graph and the compiler's first line (the full error is the cause), and the
    backend that runs every verified graph (eager)."""


class Lowering(Protocol):
    name: str
    # Passes the backend needs at the end of every pipeline (named passes, so they show in the
    # pipeline text, the records and the dumps); the compile driver appends any that are missing.
    required_passes: tuple[str, ...]

    def available(self) -> tuple[bool, str]:
        """Whether this backend can run here, and if not, what is missing."""

    def compile(self, graph: TrainGraph, example_inputs: list[torch.Tensor], plan: Any) -> Runner:
        """A callable computing the graph's outputs from its flat inputs."""


# "0" lowers every graph functionally (no input written, new parameters and state stored by the
# runtime): what the in-place updates are measured against (bench/step_time_dp.py). The compile
# driver reads it to choose the eager backend's passes (required_passes).
INPLACE_UPDATES_ENV = "CANN_PASSES_INPLACE_UPDATES"


def inplace_updates_enabled() -> bool:
    return os.environ.get(INPLACE_UPDATES_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


# "0" leaves the optimizer's step-count arithmetic as 0-dim tensor ops on the eager backend (no
# ``scalars_on_host``): what computing it as Python floats is measured against (bench.step_time's
# ours-eager-tensor-scalars row, bench.step_op_counts).
HOST_SCALARS_ENV = "CANN_PASSES_HOST_SCALARS"


def host_scalars_enabled() -> bool:
    return os.environ.get(HOST_SCALARS_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


# "0" leaves the eager backend's buffer plan out (no ``plan_buffers``: every buffer allocated afresh
# each step): what holding them is measured against (bench.step_time's ours-eager-unplanned row).
BUFFER_PLAN_ENV = "CANN_PASSES_BUFFER_PLAN"


def buffer_plan_enabled() -> bool:
    return os.environ.get(BUFFER_PLAN_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def writable_inputs(graph: TrainGraph) -> dict[torch.fx.Node, int]:
    """Inputs of ``graph`` a lowering may update in place (``graph_ir.analysis.updates``); none with
    ``$CANN_PASSES_INPLACE_UPDATES=0``."""
    return updated_inputs(graph) if inplace_updates_enabled() else {}


class GuardedRunner:
    """A lowered graph that writes some of its inputs, guarded: a call whose written inputs share
    storage with another input (or overlap themselves) runs the functional variant instead, made on
    first need. ``written_inputs``: what the step updates in place, ``kind:name``."""

    def __init__(self, run: Callable[..., Any], graph: TrainGraph, written: list[int],
                 functional: Callable[[], Callable[..., Any]]):
        self.run, self.written = run, written
        self.written_inputs = [f"{graph.signature.inputs[i].kind}:{graph.signature.inputs[i].name}" for i in written]
        self._make_functional, self._functional = functional, None

    def safe(self, inputs) -> bool:
        """Whether the written inputs of this call own their storage alone, without internal overlap."""
        if not self.written:
            return True
        storages = Counter(t.untyped_storage().data_ptr() for t in inputs
                           if isinstance(t, torch.Tensor) and t.numel())
        for i in self.written:
            t = inputs[i]
            if t.numel() and (not t.is_contiguous() or storages[t.untyped_storage().data_ptr()] != 1):
                return False
        return True

    def __call__(self, *inputs):
        if self.safe(inputs):
            return self.run(*inputs)
        if self._functional is None:
            self._functional = self._make_functional()
        return self._functional(*inputs)


def npu_available() -> tuple[bool, str]:
    # Looking for the module without importing it: importing torch_npu on a
    # machine without CANN fails (and its autoload can break torch itself).
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (pip install 'cann-recipes-train[npu]' on a CANN machine)"
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # CANN missing or broken
        return False, f"torch_npu is installed but cannot be imported: {exc}"
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        return False, "torch_npu imports but no NPU device is visible"
    return True, ""


def cxx_compiler_available() -> tuple[bool, str]:
    for cc in ("g++", "c++", "clang++"):
        if shutil.which(cc):
            return True, ""
    return False, "no C++ compiler (g++/clang++) on PATH; inductor's CPU backend needs one"
