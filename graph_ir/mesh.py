"""The device mesh as data: what passes, the compile driver and the cost model read.

A :class:`MeshDesc` names the mesh's axes (``pp``, ``dp``, ``cp``, ``tp`` by default,
in the order of the process layout), their sizes, the coordinate of the rank
being compiled for, and the process-group name of each axis as that rank
sees it. It is built two ways:

- :meth:`MeshDesc.from_device_mesh` from a live ``DeviceMesh`` at run time
  (the group names are the real ``ProcessGroup.group_name``\\ s the
  functional collectives in the graph resolve);
- :meth:`MeshDesc.fake` for any sizes with no process at all, to compile or
  cost a 64-rank plan in one process. Its group names are placeholders that
  fake-tensor propagation never resolves; such a graph is for inspection,
  not for running.

Expert parallelism adds *sub-axes* of ``dp``: ``ep`` (the ranks whose experts together make
one copy of every expert: consecutive data-parallel coordinates) and ``edp`` (the ranks holding
the same experts, whose expert gradients are averaged), with ``dp = edp x ep`` as Megatron's
expert-data-parallel layout has it. They are read like axes (``size``, ``local_rank``,
``group_name``) but are not in ``axes``: the process layout and the world stay ``(pp, dp, cp, tp)``.
With both dp and cp, ``dp_cp`` is the two flattened (dp outer), the ranks holding one parameter's
gradient in parts: over the data and over the sequence.

Passes read only this description (``ctx.mesh``), never a process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class MeshDesc:
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    coords: tuple[int, ...]          # this rank's coordinate on every axis
    groups: tuple[str, ...]          # this rank's process-group name on every axis
    fake: bool = True
    device_type: str = "cpu"
    # The process-group backend of each axis ("gloo", "nccl", "hccl"); empty on a fake mesh, which
    # has no process groups. The passes a backend needs are chosen from it (compile.required_passes).
    backends: tuple[str, ...] = ()
    # (name, size, coord, group name) of each sub-axis of dp: ``ep`` and ``edp`` under expert parallelism.
    subaxes: tuple[tuple[str, int, int, str], ...] = ()

    def __post_init__(self):
        if not (len(self.axes) == len(self.shape) == len(self.coords) == len(self.groups)):
            raise ValueError(f"mesh description: axes {self.axes}, shape {self.shape}, coords {self.coords} "
                             f"and groups {self.groups} must have one entry per axis")
        for axis, size, coord in zip(self.axes, self.shape, self.coords):
            if size < 1 or not 0 <= coord < size:
                raise ValueError(f"mesh axis '{axis}': size {size} must be >= 1 and the coordinate {coord} "
                                 f"within it")

    # -- making one -----------------------------------------------------------------------------
    @classmethod
    def fake(cls, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, rank: int = 0,
             device_type: str = "cpu") -> "MeshDesc":
        """A ``(pp, dp, cp, tp)`` mesh of any size, seen from global ``rank``; no process group behind
        it. ``ep`` > 1 adds the ``ep`` and ``edp`` sub-axes of dp (``ep`` must divide ``dp``); dp and
        cp > 1 add ``dp_cp``."""
        shape = (pp, dp, cp, tp)
        world = math.prod(shape)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a mesh of {world} ranks (pp={pp}, dp={dp}, cp={cp}, "
                             f"tp={tp})")
        if ep < 1 or dp % ep:
            raise ValueError(f"ep={ep} must divide dp={dp} (the expert-parallel ranks are data-parallel ranks)")
        coords = _unravel(rank, shape)
        groups = tuple(_fake_group_name(AXES, shape, coords, i) for i in range(len(AXES)))
        return cls(AXES, shape, coords, groups, True, device_type, (), _fake_subaxes(shape, coords, ep))

    @classmethod
    def single(cls) -> "MeshDesc":
        return cls.fake()

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> "MeshDesc":
        """The description of a live ``torch.distributed.device_mesh.DeviceMesh``, from this rank."""
        axes = tuple(mesh.mesh_dim_names)
        import torch.distributed as dist
        return cls(axes, tuple(int(mesh.size(i)) for i in range(len(axes))),
                   tuple(int(c) for c in mesh.get_coordinate()),
                   tuple(mesh.get_group(a).group_name for a in axes), False, mesh.device_type,
                   tuple(str(dist.get_backend(mesh.get_group(a))) for a in axes))

    def with_subaxes_of(self, mesh: Any, names: tuple[str, ...] = ("ep", "edp")) -> "MeshDesc":
        """This description with sub-axes ``names`` of a live mesh (one that unflattened ``dp`` into
        ``edp`` and ``ep``, or flattened ``dp`` and ``cp`` into ``dp_cp``)."""
        dims = mesh.mesh_dim_names
        coords = mesh.get_coordinate()
        return replace(self, subaxes=self.subaxes + tuple(
            (a, int(mesh.size(dims.index(a))), int(coords[dims.index(a)]), mesh.get_group(a).group_name)
            for a in names))

    def for_rank(self, rank: int) -> "MeshDesc":
        """The same mesh seen from another rank (fake meshes only: real group names are per process)."""
        if not self.fake:
            raise ValueError("a live mesh is seen from its own rank only; use MeshDesc.fake(...) to "
                             "compile for other ranks")
        coords = _unravel(rank, self.shape)
        groups = tuple(_fake_group_name(self.axes, self.shape, coords, i) for i in range(len(self.axes)))
        ep = self.size("ep") if self.has_axis("ep") else 1
        return replace(self, coords=coords, groups=groups, subaxes=_fake_subaxes(self.shape, coords, ep))

    # -- reading it (the interface passes use) ----------------------------------------------------
    def _index(self, axis: str) -> int:
        if axis not in self.axes:
            raise KeyError(f"the mesh has no axis '{axis}'; its axes are {', '.join(self.axes)}")
        return self.axes.index(axis)

    def _sub(self, axis: str) -> tuple[str, int, int, str] | None:
        return next((s for s in self.subaxes if s[0] == axis), None)

    @property
    def all_axes(self) -> tuple[str, ...]:
        """The axes and the sub-axes."""
        return self.axes + tuple(s[0] for s in self.subaxes)

    def has_axis(self, axis: str) -> bool:
        """An axis or a sub-axis of this mesh."""
        return axis in self.axes or self._sub(axis) is not None

    def size(self, axis: str) -> int:
        sub = self._sub(axis)
        return sub[1] if sub else self.shape[self._index(axis)]

    def span(self, axis: str) -> int:
        """How many consecutive global ranks one group of ``axis`` covers (its size times the sizes
        of the axes inside it, row-major): whether the group crosses a node of that many devices."""
        if axis == "ep" and self._sub(axis):   # ep is the inner part of dp
            return self.size("ep") * math.prod(self.shape[self._index("dp") + 1:])
        if axis in ("edp", "dp_cp") and self._sub(axis):
            return self.span("dp")
        i = self._index(axis)
        return math.prod(self.shape[i:])

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate on ``axis``."""
        sub = self._sub(axis)
        return sub[2] if sub else self.coords[self._index(axis)]

    def group_name(self, axis: str) -> str:
        sub = self._sub(axis)
        return sub[3] if sub else self.groups[self._index(axis)]

    def group_size(self, group_name: str) -> int | None:
        """The size of the axis whose process group is called ``group_name`` here (None: not this mesh's)."""
        for axis, name in zip(self.axes, self.groups):
            if name == group_name:
                return self.size(axis)
        for _, size, _, name in self.subaxes:
            if name == group_name:
                return size
        return None

    def rank_in_group(self, group_name: str) -> int | None:
        """This rank's index in the axis' group called ``group_name`` (None: not this mesh's)."""
        return next((self.local_rank(a) for a in self.all_axes if self.group_name(a) == group_name), None)

    def backend_of_group(self, group_name: str | None) -> str | None:
        """The backend of an axis' group; a group the runtime makes beside the axes (a pipeline
        subgroup) has the mesh's backend when every axis has the same one. None on a fake mesh."""
        if not self.backends:
            return None
        for name, backend in zip(self.groups, self.backends):
            if name == group_name:
                return backend
        if any(name == group_name for *_, name in self.subaxes):
            return self.backends[self.axes.index("dp")]
        return self.backends[0] if len(set(self.backends)) == 1 else None

    @property
    def rank(self) -> int:
        """This rank's global rank (row-major over the axes, as ``init_device_mesh`` lays them out)."""
        return _ravel(self.coords, self.shape)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axes, self.shape))

    def to_json(self) -> dict:
        return {"axes": list(self.axes), "shape": list(self.shape), "coords": list(self.coords),
                "groups": list(self.groups), "fake": self.fake, "device_type": self.device_type,
                "backends": list(self.backends), "subaxes": [list(s) for s in self.subaxes]}

    @classmethod
    def from_json(cls, data: dict) -> "MeshDesc":
        return cls(tuple(data["axes"]), tuple(data["shape"]), tuple(data["coords"]), tuple(data["groups"]),
                   bool(data.get("fake", True)), data.get("device_type", "cpu"), tuple(data.get("backends", ())),
                   tuple((str(a), int(n), int(c), str(g)) for a, n, c, g in data.get("subaxes", ())))

    def __str__(self) -> str:
        sizes = " x ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))
        if self.subaxes:
            sizes += " (" + " x ".join(f"{a}={n}" for a, n, *_ in reversed(self.subaxes)) + ")"
        return f"mesh({sizes}; rank {self.rank}{', fake' if self.fake else ''})"


def _unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def _ravel(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    rank = 0
    for c, size in zip(coords, shape):
        rank = rank * size + c
    return rank


def _fake_subaxes(shape, coords, ep: int) -> tuple:
    """The ``ep`` and ``edp`` sub-axes of a fake ``(pp, dp, cp, tp)`` mesh: dp coordinate ``d`` is
    ``edp * ep + ep_rank`` (ep inner, as DeviceMesh._unflatten lays it out); and ``dp_cp`` (dp
    outer, as DeviceMesh._flatten lays it out)."""
    pp, dp, cp, tp = coords
    flat = (("dp_cp", shape[1] * shape[2], dp * shape[2] + cp, f"fake:dp_cp[pp{pp},tp{tp}]"),) \
        if shape[1] > 1 and shape[2] > 1 else ()
    if ep == 1:
        return flat
    e, x = dp % ep, dp // ep
    return (("ep", ep, e, f"fake:ep[pp{pp},edp{x},cp{cp},tp{tp}]"),
            ("edp", shape[1] // ep, x, f"fake:edp[pp{pp},ep{e},cp{cp},tp{tp}]")) + flat


def _fake_group_name(axes, shape, coords, i: int) -> str:
    # Ranks that differ only on axis i share that axis' group: name it by the other coordinates.
    others = ",".join(f"{a}{c}" for j, (a, c) in enumerate(zip(axes, coords)) if j != i)
    return f"fake:{axes[i]}[{others}]" if others else f"fake:{axes[i]}"
