"""The lowering interface and the choice of backend.

A lowering turns a final TrainGraph into a callable ``run(*flat_inputs) ->
list of outputs`` in the graph's signature order. ``auto`` picks torchair
where an Ascend NPU is usable, inductor where a C++ toolchain exists (its CPU
code generator needs one), and eager otherwise.
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
from graph_ir.analysis.collectives import collective_kind, group_name_of, is_communication_op
from graph_ir.meta import GraphKind, Region, graph_kind, region_of
from graph_ir.signature import InputKind

Runner = Callable[..., Any]


class BackendUnavailable(RuntimeError):
    pass


class Lowering(Protocol):
    name: str
    # Passes the backend needs at the end of every pipeline (named passes, so they show in the
    # pipeline text, the records and the dumps); the compile driver appends any that are missing.
    required_passes: tuple[str, ...]

    def available(self) -> tuple[bool, str]:
        """Whether this backend can run here, and if not, what is missing."""

    def compile(self, graph: TrainGraph, example_inputs: list[torch.Tensor], plan: Any) -> Runner:
        """A callable computing the graph's outputs from its flat inputs."""


# Inputs the runtime owns and stores back after the step; the batch and hyperparameters are the user's.
WRITABLE_INPUTS = (InputKind.PARAM.value, InputKind.BUFFER.value, InputKind.OPT_STATE.value)
# Graphs whose updated inputs the runtime stores right after the call, with no other graph holding
# an older view of them in between (pipeline stages pass saved values between calls).
INPUT_WRITING_GRAPHS = (GraphKind.STEP, GraphKind.APPLY)
# "0" lowers every graph functionally (no input written, new parameters and state stored by the
# runtime; the eager backend's collectives functional too): what the in-place updates are measured
# against (bench/step_time_dp.py).
INPLACE_UPDATES_ENV = "CANN_PASSES_INPLACE_UPDATES"


def inplace_updates_enabled() -> bool:
    return os.environ.get(INPLACE_UPDATES_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def writable_inputs(graph: TrainGraph) -> dict[torch.fx.Node, int]:
    """Inputs of ``graph`` a lowering may update in place: placeholder -> index of the output that is its
    new value (a parameter, buffer or optimizer state the graph also returns, in a step or apply graph).
    Under data parallelism and ZeRO as in one process; the eager lowering decides where the writes may
    start (after every gradient reduction). None with ``$CANN_PASSES_INPLACE_UPDATES=0``."""
    if graph_kind(graph.attrs) not in INPUT_WRITING_GRAPHS or not inplace_updates_enabled():
        return {}
    outputs = {(s.kind, s.name): i for i, s in enumerate(graph.signature.outputs)}
    return {node: outputs[(spec.kind, spec.name)]
            for node, spec in zip(graph.placeholders(), graph.signature.inputs)
            if spec.kind in WRITABLE_INPUTS and (spec.kind, spec.name) in outputs}


def _collective(node: torch.fx.Node) -> torch.fx.Node:
    """The collective a communication node performs or waits for."""
    if collective_kind(node) is None and node.args and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return node


def distributes_update(node: torch.fx.Node) -> bool:
    """Whether a communication node is an all-gather (or its wait) of values the optimizer computed:
    the one kind of collective that may follow a write of an input."""
    c = _collective(node)
    return collective_kind(c) == "all_gather" and bool(c.all_input_nodes) and all(
        a.op == "call_function" and region_of(a) == Region.OPTIMIZER and not is_communication_op(a)
        for a in c.all_input_nodes)


def wait_for_reductions_first(graph: torch.fx.Graph) -> int:
    """Move to the optimizer region's start what the optimizer must finish before it may write an
    input: the wait of every collective issued before the region (the gradient reductions), and each
    collective of the region's own but the all-gathers of the update (the clipping norm's all-reduce,
    an overflow flag) together with the region's ops it reads. Waits and collectives move nothing
    by themselves; only where the step blocks changes, so a lowering can write inputs from there on
    with every reduction done (the eager lowering does; another lowering that orders its writes
    after the waits can). Returns how many nodes moved."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    start = next((i for i, n in enumerate(nodes) if region_of(n) == Region.OPTIMIZER), None)
    if start is None:
        return 0
    before = set(nodes[:start])
    first: set[torch.fx.Node] = set()
    for n in nodes[start:]:
        if not is_communication_op(n) or distributes_update(n):
            continue
        stack = [n]
        while stack:
            m = stack.pop()
            if m not in first and m not in before and m.op == "call_function":
                first.add(m)
                stack.extend(m.all_input_nodes)
    moving = [n for n in nodes[start:] if n in first]
    anchor = next((n for n in nodes[start:] if n not in first), None)
    if anchor is None or nodes[start:start + len(moving)] == moving:
        return 0
    for n in moving:
        anchor.prepend(n)
    return len(moving)


def group_backend(group_name: str | None) -> str | None:
    """The backend of the live process group a collective names; None when there is none (no
    process group in this process: a step compiled for costing or for the compile cache)."""
    import torch.distributed as dist
    if group_name is None or not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    try:
        return str(dist.get_backend(_resolve_process_group(group_name)))
    except (ValueError, RuntimeError, KeyError):
        return None


def _waits(collective: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in collective.users if is_communication_op(u) and collective_kind(u) is None]


def gloo_all_gathers_alone(graph: torch.fx.Graph,
                           backend_of: Callable[[str | None], str | None] = group_backend) -> int:
    """Run every all-gather on a gloo process group alone: first wait for each collective still in
    flight on gloo, then issue the all-gather and wait for it at once.

    torch 2.13's gloo backend now and then corrupts the heap when an all-gather runs beside other
    collectives on its worker threads: ZeRO-1 steps on 2 gloo ranks under load died in ``malloc()``
    ("unaligned tcache chunk detected", "corrupted double-linked list") inside gloo's
    ``AsyncAllgatherCoalescedWork``, about one call in a thousand, with and without our in-place
    rewrites, and still when each all-gather alone was waited at once (the reduce-scatters, gloo
    all-reduces underneath, still in flight). Data-parallel steps, all-reduces alone in flight, ran
    8,000 calls clean, so all-reduces and reduce-scatters keep their overlap; HCCL and NCCL groups
    keep all of it. Only where the step blocks changes: results are bitwise the same.
    ``backend_of`` maps a group name to its backend (the live process group's by default). Returns
    how many waits moved."""
    moved = 0
    in_flight: dict[torch.fx.Node, None] = {}     # gloo collectives issued and not yet waited for
    for node in list(graph.nodes):
        if collective_kind(node) is None:
            if is_communication_op(node):          # a wait
                in_flight.pop(_collective(node), None)
            continue
        if backend_of(group_name_of(node)) != "gloo":
            continue
        if collective_kind(node) != "all_gather":
            in_flight[node] = None
            continue
        for c in in_flight:
            for wait in _waits(c):
                node.prepend(wait)
                moved += 1
        in_flight.clear()
        at = node
        for wait in _waits(node):
            if at.next is not wait:
                at.append(wait)
                moved += 1
            at = wait
    return moved


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


def required_passes(name: str) -> tuple[str, ...]:
    """The passes backend ``name`` needs at the end of a pipeline."""
    return tuple(getattr(get_lowering(name), "required_passes", ()))


def get_lowering(name: str) -> Lowering:
    from .eager import EagerLowering
    from .inductor import InductorLowering
    from .torchair import TorchairLowering
    table = {"eager": EagerLowering, "inductor": InductorLowering, "torchair": TorchairLowering}
    if name not in table:
        raise BackendUnavailable(f"unknown backend '{name}'; choose one of {', '.join(table)} or auto")
    return table[name]()


def resolve_backend(name: str) -> str:
    """The concrete backend for ``name``; ``auto`` -> torchair on NPU, else inductor, else eager."""
    if name != "auto":
        ok, why = get_lowering(name).available()
        if not ok:
            raise BackendUnavailable(f"backend '{name}' is not usable here: {why}")
        return name
    for candidate in ("torchair", "inductor"):
        if get_lowering(candidate).available()[0]:
            return candidate
    return "eager"


def available_backends() -> dict[str, str]:
    """Each backend -> '' if usable, else what is missing."""
    return {n: get_lowering(n).available()[1] for n in ("eager", "inductor", "torchair")}
