"""DTensor placements: of a parameter layout, and the questions the re-trace asks of a value's."""
from __future__ import annotations

import torch

from .layouts import ParamLayout


def dtensor_placement(layout: ParamLayout | None):
    """A fused projection's per-part split is a ``_StridedShard``: each rank's block of every part."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if layout is None or layout.dim is None:
        return Replicate()
    if layout.parts > 1:
        return _StridedShard(layout.dim, split_factor=layout.parts)
    return Shard(layout.dim)


def local_shape(shape, placement, size: int) -> list[int]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    shape = list(shape)
    if isinstance(placement, (Shard, _StridedShard)):
        shape[placement.dim] //= size
    return shape


def strided(value) -> bool:
    """A per-part shard (of a fused projection), which DTensor cannot redistribute."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard
    return isinstance(value, DTensor) and isinstance(value.placements[0], _StridedShard)


def all_partial(args) -> bool:
    from torch.distributed.tensor import DTensor, Partial
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(isinstance(a, DTensor) and isinstance(a.placements[0], Partial)
                                 for a in tensors)
