"""Op-level calibration of a measured profile: every distinct op of a graph timed in isolation.

On a CPU the roofline's few rates do not describe the ops well enough to predict a step: the
same FLOPs run at half the rate in attention's small batched matmuls as in a projection, and
one elementwise op costs 20x another per byte (``gelu(approximate='tanh')`` against ``add``).
So a measured profile can carry a table of seconds per op *signature* (the op, its overload,
every tensor argument's shape, strides and dtype, every other argument's value), filled by
timing each distinct signature of the graphs to be predicted, alone, on random inputs, from
Python as the eager backend's generated code calls it (one dispatch included). The roofline
prices what the table lacks.

The table holds microbenchmarks of single ops, never a step's time: a step is predicted by the
simulator's own composition (node order, two streams, alpha-beta collectives, schedule).
What isolation cannot see: caches cold or warm differently than in the step, allocator reuse
(the eager backend rewrites dying operands in place), memory-bandwidth contention with other
processes; the prediction keeps those errors.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from graph_ir.analysis.collectives import is_communication_op
from graph_ir.meta import tensors_of

from .profiles import DeviceProfile


def is_launched(node: torch.fx.Node) -> bool:
    """An aten (or other registered) op the runtime dispatches; Python helpers such as
    ``operator.getitem`` on an op's tuple output launch nothing."""
    return node.op == "call_function" and isinstance(node.target, (torch._ops.OpOverload,
                                                                   torch._ops.OpOverloadPacket))


def _describe(value) -> str:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return f"T{tuple(val.shape)}{tuple(val.stride())}{val.dtype}"
        return f"V{val!r}"
    return repr(value)


def op_key(node: torch.fx.Node) -> str:
    """The signature an op's time depends on: target, argument layouts and values."""
    args = tree_map(_describe, (tuple(node.args), dict(sorted(node.kwargs.items()))),
                    is_leaf=lambda x: isinstance(x, torch.fx.Node))
    return f"{node.target}{args}"


def _example(val) -> torch.Tensor:
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="cpu")
    if t.dtype.is_floating_point:
        # positive and well inside the normal range: sqrt, log, rsqrt of a negative give NaN,
        # which takes a slow path on x86 (20x for sqrt), and no step feeds those ops negatives
        t.uniform_(0.5, 1.5)
    elif t.dtype.is_complex:
        t.real.uniform_(0.5, 1.5)
    else:
        t.zero_()    # index-like inputs (embedding, gather, nll_loss targets): 0 is always in range
    return t


def _inputs(node: torch.fx.Node):
    def real(x):
        if isinstance(x, torch.fx.Node):
            val = x.meta.get("val")
            if isinstance(val, torch.Tensor):
                return _example(val)
            if isinstance(val, (int, float, bool)):
                return val
            raise TypeError(f"input {x.name} has no tensor or scalar value")
        return x
    return tree_map(real, (tuple(node.args), dict(node.kwargs)), is_leaf=lambda x: isinstance(x, torch.fx.Node))


def measurable(node: torch.fx.Node) -> bool:
    if not is_launched(node) or is_communication_op(node):
        return False
    values = [a.meta.get("val") for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, torch.fx.Node)]
    if any(isinstance(v, torch.Tensor) and (v.device.type not in ("cpu", "meta") or v.is_sparse
                                            or not _static(v)) for v in values):
        return False
    return all(_static(t) for t in tensors_of(node.meta.get("val")))


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*t.shape, *t.stride()))


# Inputs are rotated through copies totalling at least this many bytes, so that each call finds
# its operands out of the core's private caches (L2 is 0.5-2 MiB per core on current x86), as in a
# training step, whose working set (weights, saved activations, optimizer state) is far larger:
# a weight is next read one whole pass later, and most activations are read again in backward.
EVICT_BYTES = 8 * 2**20
MAX_COPIES = 16


def time_op(node: torch.fx.Node, *, target_s: float = 2e-3, max_repeats: int = 25) -> float:
    """Median seconds (this thread's CPU time) of one call of ``node``'s op on random inputs of its
    layouts, rotated through copies (``EVICT_BYTES``); as many repeats as fit in about ``target_s``,
    at least 3."""
    first_set = _inputs(node)
    size = sum(t.untyped_storage().nbytes() for t in tree_flatten(first_set)[0] if isinstance(t, torch.Tensor))
    copies = max(1, min(MAX_COPIES, -(-EVICT_BYTES // max(size, 1))))
    sets = [first_set] + [_inputs(node) for _ in range(copies - 1)]
    op = node.target
    for args, kwargs in sets:             # first calls: lazy init, allocator warm-up
        op(*args, **kwargs)
    t0 = time.thread_time()
    op(*sets[0][0], **sets[0][1])
    first = time.thread_time() - t0
    repeats = max(3, min(max_repeats, int(target_s / max(first, 1e-7))))
    times = []
    for i in range(repeats):
        args, kwargs = sets[(i + 1) % copies]
        t0 = time.thread_time()
        op(*args, **kwargs)
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def measure_ops(graphs, **kwargs) -> dict[str, float]:
    """Seconds per op signature of every launched, measurable node of ``graphs`` (fx Graphs or
    GraphModules), each signature timed once. Ops whose inputs cannot be made up (a node without
    a tensor value) are left to the roofline."""
    table: dict[str, float] = {}
    for graph in graphs:
        graph = getattr(graph, "graph", graph)
        for node in graph.nodes:
            if not measurable(node):
                continue
            key = op_key(node)
            if key in table:
                continue
            try:
                table[key] = time_op(node, **kwargs)
            except Exception:       # noqa: BLE001 - an op that refuses made-up inputs is priced by the roofline
                continue
    return table


def with_op_table(profile: DeviceProfile, table: dict[str, float]) -> DeviceProfile:
    """``profile`` whose roofline is replaced, for the signatures in ``table``, by their measured time."""
    return dataclasses.replace(profile, op_seconds={**profile.op_seconds, **table})
