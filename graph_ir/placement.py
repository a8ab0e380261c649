"""Placements: where a value of a per-rank graph lives on the mesh, and the one shard layout code.

A :class:`Placement` gives a value's global (logical) shape and, per mesh axis,
how the ranks along that axis hold it; an axis not named is replicated:

- :class:`Replicate`: every rank holds the whole value.
- :class:`Shard` ``(dim)``: split along tensor dim ``dim`` in ``torch.chunk``
  pieces (DTensor's ``Shard``; tensor parallelism's weights).
- :class:`FlatShard`: flattened, zero-padded to a multiple of the axis size
  ``N``; rank ``r`` holds elements ``[r*s, (r+1)*s)``, ``s = ceil(numel/N)``
  (ZeRO's and FSDP's per-parameter layout; an elementwise update runs on it
  unchanged).
- :class:`Partial`: every rank holds a summand; the value is their sum.

The passes that create a sharded value write its placement (into
``graph.attrs[GraphAttr.PLACEMENTS]`` for inputs and outputs, keyed
``"kind:name"``, and into the node's ``meta[SHARDING]``). Everything that
moves values between the full and the per-rank form — the runtime's binding,
checkpoints, accumulation, the user-facing state dicts — calls this module
(:func:`shard`, :func:`unshard`, :func:`gather`, :func:`to_dtensor`), so the
layout is written once and nothing re-derives it from shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import torch

from .meta import SHARDING, GraphAttr


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class FlatShard:
    def __str__(self) -> str:
        return "S(flat)"


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"

    def __str__(self) -> str:
        return f"P({self.reduce})"


AxisPlacement = Union[Replicate, Shard, FlatShard, Partial]


@dataclass(frozen=True)
class Placement:
    shape: tuple[int, ...]                                 # the global value's shape
    axes: tuple[tuple[str, AxisPlacement], ...] = ()       # mesh axes that do not replicate it

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def replicated(cls, shape) -> "Placement":
        return cls(tuple(shape))

    @classmethod
    def flat_shard(cls, shape, axis: str) -> "Placement":
        return cls(tuple(shape), ((axis, FlatShard()),))

    @classmethod
    def sharded(cls, shape, dim: int, axis: str) -> "Placement":
        return cls(tuple(shape), ((axis, Shard(dim)),))

    @classmethod
    def partial(cls, shape, axis: str, reduce: str = "sum") -> "Placement":
        return cls(tuple(shape), ((axis, Partial(reduce)),))

    # -- reading ----------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def on(self, axis: str) -> AxisPlacement:
        return dict(self.axes).get(axis, Replicate())

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for _, p in self.axes)

    def _single_axis(self) -> tuple[str, AxisPlacement] | None:
        active = [(a, p) for a, p in self.axes if not isinstance(p, Replicate)]
        if len(active) > 1:
            raise NotImplementedError(f"placement {self}: values placed on more than one mesh axis "
                                      "(tensor parallel x ZeRO) are not built yet")
        return active[0] if active else None

    def flat_shard_numel(self, n_ranks: int) -> int:
        """Elements of each rank's (padded) flat shard over ``n_ranks``."""
        return -(-self.numel // n_ranks)

    def valid_numel(self, n_ranks: int, coord: int) -> int:
        """Elements of rank ``coord``'s flat shard that are not padding."""
        size = self.flat_shard_numel(n_ranks)
        return max(0, min(size, self.numel - coord * size))

    def padding(self, n_ranks: int) -> int:
        return self.flat_shard_numel(n_ranks) * n_ranks - self.numel

    def local_shape(self, mesh) -> tuple[int, ...]:
        """The shape a rank holds, on ``mesh`` (a MeshDesc) from its coordinate."""
        active = self._single_axis()
        if active is None or isinstance(active[1], Partial):
            return self.shape
        axis, p = active
        n, coord = mesh.size(axis), mesh.local_rank(axis)
        if isinstance(p, FlatShard):
            return (self.flat_shard_numel(n),)
        size = self.shape[p.dim]
        chunk = -(-size // n)
        shape = list(self.shape)
        shape[p.dim] = max(0, min(chunk, size - coord * chunk))
        return tuple(shape)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "axes": {a: _axis_json(p) for a, p in self.axes}}

    @classmethod
    def from_json(cls, data: dict) -> "Placement":
        return cls(tuple(data["shape"]), tuple((a, _axis_from_json(p)) for a, p in data.get("axes", {}).items()))

    def __str__(self) -> str:
        where = ", ".join(f"{a}:{p}" for a, p in self.axes) or "replicated"
        return f"[{', '.join(map(str, self.shape))}] {where}"


def _axis_json(p: AxisPlacement) -> dict:
    if isinstance(p, Shard):
        return {"type": "shard", "dim": p.dim}
    if isinstance(p, FlatShard):
        return {"type": "flat_shard"}
    if isinstance(p, Partial):
        return {"type": "partial", "reduce": p.reduce}
    return {"type": "replicate"}


def _axis_from_json(data: dict) -> AxisPlacement:
    kind = data["type"]
    if kind == "shard":
        return Shard(int(data["dim"]))
    if kind == "flat_shard":
        return FlatShard()
    if kind == "partial":
        return Partial(data.get("reduce", "sum"))
    if kind == "replicate":
        return Replicate()
    raise ValueError(f"unknown placement type {kind!r}")


# -- placements of a graph's inputs and outputs ----------------------------------------------------

def key(kind: str, name: str) -> str:
    return f"{getattr(kind, 'value', kind)}:{name}"


def set_placement(tg, kind: str, name: str, placement: Placement, node: Any = None) -> None:
    """Record where the graph's input or output ``kind:name`` lives (and on its node, if given)."""
    tg.attrs.setdefault(GraphAttr.PLACEMENTS, {})[key(kind, name)] = placement.to_json()
    if node is not None:
        node.meta[SHARDING] = placement.to_json()


def placement_of(tg, kind: str, name: str) -> Placement | None:
    """The placement recorded for ``kind:name``; None where the graph holds the whole value."""
    data = tg.attrs.get(GraphAttr.PLACEMENTS, {}).get(key(kind, name))
    return None if data is None else Placement.from_json(data)


def placements(tg) -> dict[str, Placement]:
    return {k: Placement.from_json(v) for k, v in tg.attrs.get(GraphAttr.PLACEMENTS, {}).items()}


# -- moving values between the full and the per-rank form ------------------------------------------

def shard(full: torch.Tensor, placement: Placement, mesh) -> torch.Tensor:
    """This rank's piece of ``full`` (a new tensor), for ``mesh``'s coordinate (a MeshDesc)."""
    if tuple(full.shape) != placement.shape:
        raise ValueError(f"cannot shard a tensor of shape {tuple(full.shape)} as {placement}: "
                         "it is not the full value")
    active = placement._single_axis()
    if active is None:
        return full.detach().clone()
    axis, p = active
    n, coord = mesh.size(axis), mesh.local_rank(axis)
    if isinstance(p, Partial):
        return full.detach().clone() if coord == 0 else torch.zeros_like(full)
    if isinstance(p, Shard):
        pieces = torch.chunk(full.detach(), n, dim=p.dim)
        if coord < len(pieces):
            return pieces[coord].clone()
        shape = list(full.shape)
        shape[p.dim] = 0
        return full.new_empty(shape)
    flat = full.detach().reshape(-1)
    size = placement.flat_shard_numel(n)
    piece = flat[min(coord * size, flat.numel()):(coord + 1) * size]
    return torch.nn.functional.pad(piece, (0, size - piece.numel())).clone()


def unshard(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The full value from every rank's piece along the placement's axis, in coordinate order."""
    active = placement._single_axis()
    if active is None:
        return pieces[0].clone()
    _, p = active
    if isinstance(p, Partial):
        return torch.stack(list(pieces)).sum(0)
    if isinstance(p, Shard):
        return torch.cat(list(pieces), dim=p.dim)
    return torch.cat([x.reshape(-1) for x in pieces])[:placement.numel].view(placement.shape).clone()


def gather(local: torch.Tensor, placement: Placement, group) -> torch.Tensor:
    """The full value from this rank's piece: a collective over ``group`` (the axis' process group)."""
    import torch.distributed as dist
    active = placement._single_axis()
    if active is None:
        return local
    _, p = active
    if isinstance(p, Partial):
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    if isinstance(p, Shard):
        # torch.chunk pieces may differ in size along dim: pad to the first piece's size.
        size = -(-placement.shape[p.dim] // len(pieces))
        padded = torch.nn.functional.pad(local.movedim(p.dim, -1), (0, size - local.shape[p.dim]))
        pieces = [torch.empty_like(padded) for _ in pieces]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([x.movedim(-1, p.dim) for x in pieces], dim=p.dim).narrow(
            p.dim, 0, placement.shape[p.dim]).clone()
    dist.all_gather(pieces, local.contiguous(), group=group)
    return unshard(pieces, placement)


def to_dtensor(local: torch.Tensor, placement: Placement, device_mesh, mesh) -> Any:
    """This rank's piece as a ``DTensor`` on ``device_mesh`` (the axis' 1-D sub-mesh).

    A flat shard becomes a 1-D DTensor of the value's element count sharded on
    dim 0 with its padding dropped (DTensor's ``Shard(0)`` pieces are the same
    elements), so its global layout does not depend on the number of ranks.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    active = placement._single_axis()
    if active is None:
        return DTensor.from_local(local, device_mesh, [DReplicate()], run_check=False)
    axis, p = active
    if isinstance(p, Partial):
        return DTensor.from_local(local, device_mesh, [DPartial(p.reduce)], run_check=False)
    if isinstance(p, Shard):
        return DTensor.from_local(local, device_mesh, [DShard(p.dim)], run_check=False,
                                  shape=torch.Size(placement.shape), stride=_contiguous_stride(placement.shape))
    valid = placement.valid_numel(mesh.size(axis), mesh.local_rank(axis))
    return DTensor.from_local(local[:valid], device_mesh, [DShard(0)], run_check=False,
                              shape=torch.Size([placement.numel]), stride=(1,))


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
