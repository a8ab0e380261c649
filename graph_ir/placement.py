"""Placements: where a value of a per-rank graph lives on the mesh, and the one shard layout code.

A :class:`Placement` gives a value's global (logical) shape and, per mesh axis,
how the ranks along that axis hold it; an axis not named is replicated:

- :class:`Replicate`: every rank holds the whole value.
- :class:`Shard` ``(dim, parts=1)``: split along tensor dim ``dim`` in
  ``torch.chunk`` pieces (DTensor's ``Shard``; tensor parallelism's weights).
  With ``parts`` > 1 the dim is first cut into ``parts`` equal blocks and each
  block is split so: a fused projection (q, k and v side by side) gives every
  rank its piece of each part (DTensor's ``_StridedShard``).
- :class:`FlatShard`: flattened, zero-padded to a multiple of the axis size
  ``N``; rank ``r`` holds elements ``[r*s, (r+1)*s)``, ``s = ceil(numel/N)``
  (ZeRO's and FSDP's per-parameter layout; an elementwise update runs on it
  unchanged).
- :class:`Partial`: every rank holds a summand; the value is their sum.

A value may be placed on several axes: ``axes`` are applied in their order,
each to the piece the previous ones left. ZeRO over tensor parallelism is
``(("tp", Shard(d)), ("dp", FlatShard()))``: the tensor-parallel shard,
flattened and flat-sharded over the data-parallel ranks (a flat shard comes
last; a partial sum is placed on one axis alone).

The passes that create a sharded value write its placement (into
``graph.attrs[GraphAttr.PLACEMENTS]`` for inputs and outputs, keyed
``"kind:name"``, and into the node's ``meta[SHARDING]``). Everything that
moves values between the full and the per-rank form — the runtime's binding,
checkpoints, accumulation, the user-facing state dicts — calls this module
(:func:`shard`, :func:`unshard`, :func:`gather`, :func:`flat_runs`,
:func:`to_dtensor`), so the
layout is written once and nothing re-derives it from shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import torch

from .meta import SHARDING, GraphAttr


# On a node holding this rank's piece of a random draw (a dropout mask drawn whole, so the numbers
# are the single-process ones, and cut to the shard it multiplies): the draw's node name. Passes
# that keep masks for backward (recompute) keep this piece, not the whole draw.
RANDOM_PIECE = "random_piece"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    parts: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.parts == 1 else f"S({self.dim}, {self.parts} parts)"


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
    def sharded(cls, shape, dim: int, axis: str, parts: int = 1) -> "Placement":
        return cls(tuple(shape), ((axis, Shard(dim, parts)),))

    def then(self, axis: str, how: "AxisPlacement") -> "Placement":
        """This placement, with its piece placed ``how`` over ``axis`` as well (ZeRO over TP)."""
        if any(a == axis for a, _ in self.axes):
            raise ValueError(f"placement {self}: already placed on mesh axis '{axis}'")
        return Placement(self.shape, self.axes + ((axis, how),))

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

    def _active(self) -> list[tuple[str, AxisPlacement]]:
        """The axes that do not replicate the value, in the order they apply; refuses what no code
        here can lay out."""
        active = [(a, p) for a, p in self.axes if not isinstance(p, Replicate)]
        if len(active) > 1:
            if any(isinstance(p, Partial) for _, p in active):
                raise NotImplementedError(f"placement {self}: a partial sum placed on more than one mesh "
                                          "axis has no layout here")
            if any(isinstance(p, FlatShard) for _, p in active[:-1]):
                raise NotImplementedError(f"placement {self}: a flat shard must be the last axis "
                                          "(what comes after it has no dimensions to split)")
        return active

    def _single_axis(self) -> tuple[str, AxisPlacement] | None:
        active = self._active()
        if len(active) > 1:
            raise NotImplementedError(f"placement {self}: this operation takes a value placed on one mesh "
                                      "axis; use shard / gather / flat_runs for several")
        return active[0] if active else None

    def inner_shape(self, mesh, upto: int | None = None) -> tuple[int, ...]:
        """The shape after the first ``upto`` active axes (all: the local shape), on ``mesh``."""
        shape = self.shape
        for axis, p in self._active()[:upto]:
            shape = _piece_shape(shape, p, mesh.size(axis), mesh.local_rank(axis))
        return shape

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
        return self.inner_shape(mesh)

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
        return {"type": "shard", "dim": p.dim, **({"parts": p.parts} if p.parts > 1 else {})}
    if isinstance(p, FlatShard):
        return {"type": "flat_shard"}
    if isinstance(p, Partial):
        return {"type": "partial", "reduce": p.reduce}
    return {"type": "replicate"}


def _axis_from_json(data: dict) -> AxisPlacement:
    kind = data["type"]
    if kind == "shard":
        return Shard(int(data["dim"]), int(data.get("parts", 1)))
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

def _piece_shape(shape: tuple[int, ...], p: AxisPlacement, n: int, coord: int) -> tuple[int, ...]:
    """The shape of rank ``coord``'s piece (of ``n``) of a value of ``shape`` placed ``p`` on one axis."""
    if isinstance(p, (Partial, Replicate)):
        return tuple(shape)
    if isinstance(p, FlatShard):
        return (-(-math.prod(shape) // n),)
    shape = list(shape)
    block = shape[p.dim] // p.parts
    chunk = -(-block // n)
    shape[p.dim] = p.parts * max(0, min(chunk, block - coord * chunk))
    return tuple(shape)


def _blocks(t: torch.Tensor, p: Shard) -> tuple[torch.Tensor, ...]:
    return torch.tensor_split(t, p.parts, dim=p.dim) if p.parts > 1 else (t,)


def _cut(t: torch.Tensor, p: AxisPlacement, n: int, coord: int) -> torch.Tensor:
    """Rank ``coord``'s piece of ``t`` (the value before this axis), a new tensor."""
    if isinstance(p, Replicate):
        return t.detach().clone()
    if isinstance(p, Partial):
        return t.detach().clone() if coord == 0 else torch.zeros_like(t)
    if isinstance(p, Shard):
        out = []
        for block in _blocks(t.detach(), p):
            pieces = torch.chunk(block, n, dim=p.dim)
            if coord < len(pieces):
                out.append(pieces[coord])
            else:
                shape = list(block.shape)
                shape[p.dim] = 0
                out.append(block.new_empty(shape))
        return torch.cat(out, dim=p.dim).clone() if len(out) > 1 else out[0].clone()
    flat = t.detach().reshape(-1)
    size = -(-flat.numel() // n)
    piece = flat[min(coord * size, flat.numel()):(coord + 1) * size]
    return torch.nn.functional.pad(piece, (0, size - piece.numel())).clone()


def _join(pieces: list[torch.Tensor], p: AxisPlacement, shape: tuple[int, ...]) -> torch.Tensor:
    """The value of ``shape`` (before this axis) from every rank's piece along it, in coordinate order."""
    if isinstance(p, Replicate):
        return pieces[0].clone()
    if isinstance(p, Partial):
        return torch.stack(list(pieces)).sum(0)
    if isinstance(p, Shard):
        per_rank = [_blocks(x, p) for x in pieces]
        return torch.cat([x[b] for b in range(p.parts) for x in per_rank], dim=p.dim)
    return torch.cat([x.reshape(-1) for x in pieces])[:math.prod(shape)].view(shape).clone()


def _shapes(placement: Placement, coords: list[int], sizes: list[int]) -> list[tuple[int, ...]]:
    """The value's shape before each active axis (and, last, the local shape)."""
    shapes = [placement.shape]
    for (_, p), n, c in zip(placement._active(), sizes, coords):
        shapes.append(_piece_shape(shapes[-1], p, n, c))
    return shapes


def shard(full: torch.Tensor, placement: Placement, mesh) -> torch.Tensor:
    """This rank's piece of ``full`` (a new tensor), for ``mesh``'s coordinate (a MeshDesc)."""
    if tuple(full.shape) != placement.shape:
        raise ValueError(f"cannot shard a tensor of shape {tuple(full.shape)} as {placement}: "
                         "it is not the full value")
    active = placement._active()
    if not active:
        return full.detach().clone()
    value = full
    for axis, p in active:
        value = _cut(value, p, mesh.size(axis), mesh.local_rank(axis))
    return value


def unshard(pieces: list, placement: Placement) -> torch.Tensor:
    """The full value from every rank's piece, in coordinate order: a list over the placement's axis,
    or for a value on several axes nested lists, the outer one over the first axis."""
    def rebuild(pieces, shape, active):
        if not active:
            return pieces
        p = active[0][1]
        n = len(pieces)
        inner = [rebuild(pieces[c], _piece_shape(shape, p, n, c), active[1:]) for c in range(n)]
        return _join(inner, p, shape)
    active = placement._active()
    if not active:
        return pieces[0].clone()
    return rebuild(pieces, placement.shape, active)


def gather(local: torch.Tensor, placement: Placement, group) -> torch.Tensor:
    """The full value from this rank's piece: a collective over the process group of every axis the
    value is placed on. ``group``: that group (a value on one axis) or ``axis -> group``."""
    import torch.distributed as dist
    active = placement._active()
    if not active:
        return local
    if not callable(group):
        if len(active) > 1:
            raise ValueError(f"gather of a value placed {placement}: give axis -> process group, one "
                             "group per axis")
        group_of = lambda axis, g=group: g  # noqa: E731
    else:
        group_of = group
    groups = [group_of(axis) for axis, _ in active]
    sizes = [dist.get_world_size(g) for g in groups]
    coords = [dist.get_rank(g) for g in groups]
    shapes = _shapes(placement, coords, sizes)
    value = local
    for i in reversed(range(len(active))):
        value = _gather_axis(value, active[i][1], shapes[i], groups[i], sizes[i])
    return value


def _gather_axis(local: torch.Tensor, p: AxisPlacement, shape, group, n: int) -> torch.Tensor:
    import torch.distributed as dist
    if isinstance(p, Partial):
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out
    if isinstance(p, FlatShard):
        pieces = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return _join(pieces, p, shape)
    # torch.chunk pieces may differ in size along dim: pad every block to the first rank's size.
    widest = _piece_shape(shape, p, n, 0)[p.dim] // p.parts
    padded = torch.cat([torch.nn.functional.pad(b.movedim(p.dim, -1), (0, widest - b.shape[p.dim]))
                        for b in _blocks(local, p)], dim=-1).contiguous()
    gathered = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(gathered, padded, group=group)
    pieces = []
    for c, x in enumerate(gathered):
        mine = _piece_shape(shape, p, n, c)[p.dim] // p.parts
        blocks = torch.tensor_split(x, p.parts, dim=-1)
        pieces.append(torch.cat([b[..., :mine] for b in blocks], dim=-1).movedim(-1, p.dim))
    return _join(pieces, p, shape)


def flat_runs(placement: Placement, mesh) -> list[tuple[int, int, int]]:
    """Where this rank's piece lies in the full value, flattened (row-major): runs
    ``(global_offset, local_offset, length)``, ``local_offset`` into the piece flattened; padding
    is in no run. A checkpoint stores every value flat, so its layout on disk is the same for
    every mesh and placement (``cann_passes.runtime.checkpoint``)."""
    runs = [(0, 0, placement.numel)]
    shape = placement.shape
    for axis, p in placement._active():
        if isinstance(p, Partial):
            raise ValueError(f"flat_runs of a value placed {placement}: a partial sum has no piece of "
                             "the value; reduce it first")
        n, coord = mesh.size(axis), mesh.local_rank(axis)
        runs = _compose(runs, _axis_runs(shape, p, n, coord))
        shape = _piece_shape(shape, p, n, coord)
    return runs


def _axis_runs(shape, p: AxisPlacement, n: int, coord: int) -> list[tuple[int, int, int]]:
    """Runs ``(offset before the axis, offset in the piece, length)`` of one axis' cut."""
    numel = math.prod(shape)
    if isinstance(p, FlatShard):
        size = -(-numel // n)
        valid = max(0, min(size, numel - coord * size))
        return [(coord * size, 0, valid)] if valid else []
    outer, inner = math.prod(shape[:p.dim]), math.prod(shape[p.dim + 1:])
    block = shape[p.dim] // p.parts
    chunk = -(-block // n)
    start, length = coord * chunk, max(0, min(chunk, block - coord * chunk))
    local_dim = p.parts * length
    runs = []
    for o in range(outer):
        for b in range(p.parts):
            runs.append(((o * shape[p.dim] + b * block + start) * inner, (o * local_dim + b * length) * inner,
                         length * inner))
    return _merge([r for r in runs if r[2]])


def _compose(outer: list[tuple[int, int, int]], inner: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Runs mapping the inner piece to the full value, from the outer piece's runs (full <- outer
    piece) and the inner cut's runs (outer piece <- inner piece)."""
    import bisect
    starts = [r[1] for r in outer]
    out = []
    for src, dst, length in inner:
        i = max(0, bisect.bisect_right(starts, src) - 1)
        while length > 0:
            g, loc, n = outer[i]
            take = min(length, loc + n - src)
            out.append((g + src - loc, dst, take))
            src, dst, length, i = src + take, dst + take, length - take, i + 1
    return _merge(out)


def _merge(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    merged: list[tuple[int, int, int]] = []
    for g, loc, n in runs:
        if merged and merged[-1][0] + merged[-1][2] == g and merged[-1][1] + merged[-1][2] == loc:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((g, loc, n))
    return merged


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
        if p.parts > 1:
            raise NotImplementedError(f"to_dtensor of a value placed {placement}: a per-part shard is "
                                      "DTensor's private _StridedShard; use flat_runs")
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
