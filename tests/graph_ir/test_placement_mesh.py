"""Placements and the mesh description: the one shard layout, and meshes as data."""
from __future__ import annotations

import pytest
import torch

from graph_ir.mesh import MeshDesc
from graph_ir.placement import FlatShard, Partial, Placement, Shard, flat_runs, shard, unshard


def test_a_fake_mesh_is_laid_out_like_init_device_mesh():
    mesh = MeshDesc.fake(pp=2, dp=4, tp=2, rank=13)         # 13 = ((1 * 4) + 2) * 2 + 1
    assert (mesh.local_rank("pp"), mesh.local_rank("dp"), mesh.local_rank("tp")) == (1, 2, 1)
    assert mesh.rank == 13 and mesh.world_size == 16 and mesh.fake
    assert mesh.group_size(mesh.group_name("dp")) == 4 and mesh.group_size("nope") is None
    # Ranks that differ only in their dp coordinate share the dp group, and no other.
    same_dp = {mesh.for_rank(r).group_name("dp") for r in (9, 11, 13, 15)}
    assert same_dp == {mesh.group_name("dp")} and mesh.for_rank(12).group_name("dp") != mesh.group_name("dp")
    assert MeshDesc.from_json(mesh.to_json()) == mesh
    with pytest.raises(ValueError, match="outside a mesh of 16 ranks"):
        MeshDesc.fake(pp=2, dp=4, tp=2, rank=16)
    with pytest.raises(KeyError, match="no axis 'ep'"):
        mesh.size("ep")


@pytest.mark.parametrize("placement", [Placement.flat_shard((5, 3), "dp"), Placement.sharded((5, 3), 0, "dp"),
                                       Placement.sharded((5, 3), 1, "dp"), Placement.partial((5, 3), "dp"),
                                       Placement.replicated((5, 3))])
def test_every_rank_s_piece_reassembles_the_value(placement):
    full = torch.arange(15.0).view(5, 3)
    pieces = [shard(full, placement, MeshDesc.fake(dp=4, rank=r)) for r in range(4)]
    torch.testing.assert_close(unshard(pieces, placement), full, rtol=0, atol=0)
    assert Placement.from_json(placement.to_json()) == placement
    assert tuple(pieces[3].shape) == placement.local_shape(MeshDesc.fake(dp=4, rank=3))


def test_flat_shards_are_padded_to_equal_pieces_with_zeros():
    placement = Placement.flat_shard((5, 3), "dp")
    pieces = [shard(torch.ones(5, 3), placement, MeshDesc.fake(dp=4, rank=r)) for r in range(4)]
    assert [p.shape[0] for p in pieces] == [4, 4, 4, 4] and pieces[3].tolist() == [1, 1, 1, 0]
    assert placement.padding(4) == 1 and placement.valid_numel(4, 3) == 3
    assert isinstance(placement.on("dp"), FlatShard) and placement.on("tp").__class__.__name__ == "Replicate"
    with pytest.raises(ValueError, match="not the full value"):
        shard(torch.ones(4), placement, MeshDesc.fake(dp=4))


@pytest.mark.parametrize("first", [Shard(0), Shard(1), Shard(0, parts=3)])
def test_zero_over_tensor_parallel_composes_a_tp_shard_and_a_dp_flat_shard(first):
    # (tp: Shard(d), then dp: FlatShard): each rank's tp piece, flat-sharded over dp, padded
    placement = Placement((6, 10), (("tp", first), ("dp", FlatShard())))
    full = torch.arange(1.0, 61.0).view(6, 10)
    meshes = [[MeshDesc.fake(dp=2, tp=3 if first.parts == 1 else 2, rank=d * (3 if first.parts == 1 else 2) + t)
               for d in range(2)] for t in range(3 if first.parts == 1 else 2)]
    pieces = [[shard(full, placement, m) for m in row] for row in meshes]
    torch.testing.assert_close(unshard(pieces, placement), full, rtol=0, atol=0)
    covered = torch.zeros(60)
    for row in meshes:
        for m in row:
            local = shard(full, placement, m).reshape(-1)
            assert tuple(local.shape) == placement.local_shape(m)
            for g, at, n in flat_runs(placement, m):   # where the piece lies in the flat full value
                torch.testing.assert_close(local[at:at + n], full.reshape(-1)[g:g + n], rtol=0, atol=0)
                covered[g:g + n] += 1
    assert covered.eq(1).all()          # every element on exactly one rank, padding on none
    assert Placement.from_json(placement.to_json()) == placement


def test_placements_no_code_can_lay_out_are_refused():
    with pytest.raises(NotImplementedError, match="flat shard must be the last axis"):
        shard(torch.ones(4, 4), Placement((4, 4), (("dp", FlatShard()), ("tp", Shard(0)))),
              MeshDesc.fake(dp=2, tp=2))
    with pytest.raises(NotImplementedError, match="partial sum placed on more than one"):
        Placement((4, 4), (("dp", Partial()), ("tp", Shard(0)))).local_shape(MeshDesc.fake(dp=2, tp=2))
