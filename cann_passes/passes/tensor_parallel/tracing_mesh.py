"""The device mesh the re-trace runs on: the live tp group, or a fake one of the same size and rank."""
from __future__ import annotations

import contextlib

from .common import TensorParallelError


@contextlib.contextmanager
def tracing_mesh(group_name: str, size: int, coord: int, device_type: str, axis: str = "tp"):
    """A 1-D DeviceMesh for DTensor's propagation: the live group if there is one, else a fake one."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield _live_mesh(group_name, device_type, axis)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    # Nothing is communicated while tracing, so a fake group stands in for the ranks.
    dist.init_process_group("fake", store=FakeStore(), rank=coord, world_size=size)
    try:
        yield init_device_mesh(device_type, (size,), mesh_dim_names=(axis,))
    finally:
        dist.destroy_process_group()


def _live_mesh(group_name: str, device_type: str, axis: str):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import _resolve_process_group
    try:
        group = _resolve_process_group(group_name)
    except Exception:
        group = None
    if group is None:
        raise TensorParallelError(
            f"process groups are live but none is named '{group_name}' (the mesh description's "
            f"{axis} group); compile with the run's own mesh description")
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(axis,))
