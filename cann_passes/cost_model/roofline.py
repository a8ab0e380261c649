"""Per-node time: a roofline of arithmetic against memory traffic.

``time = overhead + max(flops / rate, bytes / bandwidth)``, where the rate is
the matrix unit's (Cube, tensor cores) for ops that torch's flop counter
knows (matmuls, convolutions, attention) and the vector unit's otherwise,
each at the node's dtype. Views cost the profile's ``view_overhead`` (0 for
compiled graphs, an aten dispatch in eager). Collectives use the alpha-beta
model of :mod:`.collectives`. A measured profile may carry the timed cost of
the graph's own op signatures (:mod:`.calibrate`), used in their place.

A measured profile (``cpu``) also carries an effective bandwidth per op class
(elementwise, reduction, softmax, rng): on a CPU these differ several-fold
(drawing random numbers is far slower than adding), and a recompute choice
priced with one bandwidth for all would trade a cheap op for a dear one.
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir.analysis.collectives import is_communication_op
from graph_ir.analysis.cost import node_cost
from graph_ir.analysis.effects import random_op
from graph_ir.analysis.memory import aliases_input
from graph_ir.meta import tensors_of

from .calibrate import op_key
from .collectives import collective_node_time
from .profiles import DeviceProfile


def compute_dtype(node: torch.fx.Node) -> torch.dtype:
    """The dtype the arithmetic runs in: a matmul's inputs', else the widest floating output."""
    ins = [t for a in node.all_input_nodes for t in tensors_of(a.meta.get("val"))]
    outs = tensors_of(node.meta.get("val"))
    floating = [t.dtype for t in (*outs, *ins) if t.dtype.is_floating_point]
    if not floating:
        return torch.float32
    return max(floating, key=lambda d: torch.finfo(d).bits)


_SOFTMAX = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}


def op_class(node: torch.fx.Node) -> str:
    """``matmul``, ``rng``, ``softmax``, ``reduction`` (fewer output elements than its largest
    input) or ``elementwise``: the classes a measured profile times separately."""
    if node_cost(node).matmul:
        return "matmul"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if random_op(target):
            return "rng"
        if target._schema.name.split("::")[-1] in _SOFTMAX:
            return "softmax"
    outs = sum(t.numel() for t in tensors_of(node.meta.get("val")))
    ins = [t.numel() for a in node.all_input_nodes for t in tensors_of(a.meta.get("val"))]
    if ins and outs < max(ins):
        return "reduction"
    return "elementwise"


def node_time(node: torch.fx.Node, profile: DeviceProfile, *, world_size: int = 1,
              allreduce_algo: str = "ring") -> float:
    """Estimated seconds to run one node on ``profile``: its measured time where the profile has
    its signature (``op_seconds``), else the profile's per-view cost for a view and the roofline
    (one ``op_overhead`` included) for any other op. A Python helper in the graph
    (``operator.getitem`` of a multi-output op) is priced as an op too: an overestimate on a CPU
    (a tuple index), kept because the recompute solvers' costs are calibrated on it."""
    if node.op != "call_function":
        return 0.0
    if is_communication_op(node):
        return profile.op_overhead + collective_node_time(node, profile, world_size=world_size,
                                                          algorithm=allreduce_algo)
    if profile.op_seconds:
        measured = profile.op_seconds.get(op_key(node))
        if measured is not None:
            return measured
    if aliases_input(node):
        return profile.view_overhead
    cost = node_cost(node)
    dtype = compute_dtype(node)
    rate = profile.matrix_rate(dtype) if cost.matmul else profile.vector_rate(dtype)
    bandwidth = profile.memory_bandwidth
    if profile.class_bandwidth and not cost.matmul:
        bandwidth = profile.class_bandwidth.get(op_class(node), bandwidth)
    return profile.op_overhead + max(cost.flops / rate, cost.bytes / bandwidth)


def graph_time(nodes, profile: DeviceProfile, **kwargs) -> float:
    return sum(node_time(n, profile, **kwargs) for n in nodes)
