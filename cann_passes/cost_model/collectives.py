"""Alpha-beta time of collectives (Hockney model: ``alpha`` per message step, ``1/beta`` per byte).

Ring algorithms move the least data (bandwidth-optimal) but take ``p - 1``
steps per phase; trees take ``log2 p`` steps and win for small messages.
Formulas, for ``n`` bytes per rank and ``p`` ranks (Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", 2005;
NCCL's double binary tree for all-reduce, Sanders et al. 2009):

    all_reduce      ring  2(p-1) a + 2 (p-1)/p n/B     tree  2 log2(p) a + 2 n/B
    all_gather      ring  (p-1) a + (p-1)/p n_out/B    tree  log2(p) a + (p-1)/p n_out/B
    reduce_scatter  ring  (p-1) a + (p-1)/p n_in/B     tree  log2(p) a + (p-1)/p n_in/B
    all_to_all      (p-1) a + (p-1)/p n/B
    broadcast       ring  (p-1) a + n/B (pipelined)    tree  log2(p) a + n/B
"""
from __future__ import annotations

import math

import torch.fx

from graph_ir.analysis.collectives import collective_kind, group_size_of
from graph_ir.meta import nbytes

from .profiles import DeviceProfile

ALGORITHMS = ("ring", "tree")


def _link(profile: DeviceProfile, group_size: int) -> tuple[float, float]:
    """(latency, bandwidth) of the slowest link a group of this size crosses."""
    if group_size <= profile.devices_per_node:
        return profile.intra_node_latency, profile.intra_node_bandwidth
    return profile.inter_node_latency, profile.inter_node_bandwidth


def collective_time(kind: str, nbytes_: int, group_size: int, profile: DeviceProfile,
                    algorithm: str = "ring", span: int | None = None) -> float:
    """Seconds for one collective of ``kind`` over ``group_size`` ranks moving ``nbytes_``.

    ``nbytes_`` is the per-rank buffer: the input of all_reduce, reduce_scatter,
    all_to_all and broadcast, the (gathered) output of all_gather. ``span``: the consecutive
    ranks the group's members lie among (a dp group of a dp x tp mesh spans dp x tp ranks), which
    decides whether it crosses nodes; by default its own size.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"collective algorithm {algorithm!r}: must be one of {ALGORITHMS}")
    p = group_size
    if p <= 1:
        return 0.0
    alpha, bandwidth = _link(profile, max(p, span or p))
    steps_ring, steps_tree = p - 1, math.ceil(math.log2(p))
    share = (p - 1) / p * nbytes_ / bandwidth
    if kind == "all_reduce":
        if algorithm == "ring":
            return 2 * steps_ring * alpha + 2 * share
        return 2 * steps_tree * alpha + 2 * nbytes_ / bandwidth
    if kind in ("all_gather", "reduce_scatter"):
        return (steps_ring if algorithm == "ring" else steps_tree) * alpha + share
    if kind == "all_to_all":
        return steps_ring * alpha + share
    if kind == "broadcast":
        return (steps_ring if algorithm == "ring" else steps_tree) * alpha + nbytes_ / bandwidth
    raise ValueError(f"no alpha-beta model for collective {kind!r}")


def collective_node_time(node: torch.fx.Node, profile: DeviceProfile, *, world_size: int,
                         algorithm: str = "ring", span: int | None = None) -> float:
    kind = collective_kind(node)
    if kind is None:
        return 0.0
    p = group_size_of(node) or world_size
    moved = nbytes(node.meta.get("val")) if kind == "all_gather" else \
        sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes)
    return collective_time(kind, moved, p, profile, algorithm, span)
