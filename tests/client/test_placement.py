"""ucpd_client.placement: re-exports and from_dtensor (checked against torch's own arithmetic)."""

import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard, _StridedShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

import ucpd.ucl as ucl
from ucpd.errors import InvalidPlacement
from ucpd_client import placement as P


class FakeMesh:
    def __init__(self, shape, coord):
        self.shape, self._coord = tuple(shape), coord

    def get_coordinate(self):
        return self._coord


def spec(gshape, mesh_shape, coord, placements, shard_order=None):
    return SimpleNamespace(
        placements=tuple(placements), mesh=FakeMesh(mesh_shape, coord), shape=gshape, shard_order=shard_order
    )


def box_of(p, gshape):
    (f,) = ucl.resolve("t", p, _local_shape(p, gshape))
    assert f.global_shape == tuple(gshape)
    if not f.pieces:
        return None
    return f.pieces[0].box


def _local_shape(p, gshape):
    if isinstance(p, P.Replicated):
        return tuple(gshape)
    if isinstance(p, P.Shard):
        s = list(gshape)
        s[p.dim] //= p.parts
        return tuple(s)
    return p.lengths


def test_reexports_are_ucl_classes():
    assert P.Shard is ucl.Shard and P.Flat is ucl.Flat and P.placement_from_dict is ucl.placement_from_dict
    assert P.Shard(0, 1, 4) == ucl.Shard(0, 1, 4)


def test_from_dtensor_matches_torch_on_random_meshes():
    rng = random.Random(7)
    for _ in range(300):
        ndim = rng.randint(1, 3)
        gshape = tuple(rng.randint(0, 9) for _ in range(ndim))
        mesh_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        placements = [
            Replicate() if rng.random() < 0.3 else Shard(rng.randrange(ndim)) for _ in mesh_shape
        ]
        coord = [rng.randrange(n) for n in mesh_shape]
        want_shape, want_off = _compute_local_shape_and_global_offset(gshape, mesh_shape, coord, placements)
        p = P.from_dtensor(spec(gshape, mesh_shape, coord, placements))
        b = box_of(p, gshape)
        assert _local_shape(p, gshape) == tuple(want_shape), (gshape, mesh_shape, placements, coord, p)
        if b is not None:
            assert b.offsets == tuple(want_off), (gshape, mesh_shape, placements, coord, p)


def test_even_and_uneven_splits():
    assert P.from_dtensor(spec((8, 4), (4,), [1], [Shard(0)])) == P.Shard(0, 1, 4)
    assert P.from_dtensor(spec((8, 4), (2, 2), [1, 0], [Shard(0), Shard(1)])) == P.Box((4, 0), (4, 2), (8, 4))
    assert P.from_dtensor(spec((8, 4), (2, 2), [1, 1], [Shard(0), Shard(0)])) == P.Shard(0, 3, 4)
    assert P.from_dtensor(spec((10, 4), (4,), [3], [Shard(0)])) == P.Box((9, 0), (1, 4), (10, 4))
    assert P.from_dtensor(spec((10, 4), (4,), [3], [Replicate()])) == P.Replicated()
    assert P.from_dtensor(spec((2, 4), (4,), [3], [Shard(0)])) == P.Box((2, 0), (0, 4), (2, 4))


def test_shard_order_and_strided_shard():
    Entry = SimpleNamespace
    # dim 0 of 8 on mesh (2, 2): mesh dim 1 first, then mesh dim 0
    s = spec((8, 3), (2, 2), [1, 0], [Shard(0), Shard(0)], shard_order=(Entry(tensor_dim=0, mesh_dims=(1, 0)),))
    assert P.from_dtensor(s) == P.Shard(0, 1, 4)
    # FSDP2 over TP: _StridedShard(0, split_factor=tp) on the dp dim; torch agrees
    for c0 in range(2):
        for c1 in range(2):
            pl = [_StridedShard(0, split_factor=2), Shard(0)]
            p = P.from_dtensor(spec((8, 3), (2, 2), [c0, c1], pl))
            shape, off = _compute_local_shape_and_global_offset((8, 3), (2, 2), [c0, c1], pl)
            assert p == P.Shard(0, off[0] // 2, 4) and shape == (2, 3)
    with pytest.raises(InvalidPlacement, match="unevenly"):
        P.from_dtensor(spec((7, 3), (2, 2), [0, 0], [_StridedShard(0, split_factor=2), Shard(0)]))
    with pytest.raises(InvalidPlacement, match="match no sharding order"):
        P.from_dtensor(spec((8, 3), (2, 2), [0, 0], [Shard(0), _StridedShard(0, split_factor=2)]))


def test_rejections():
    with pytest.raises(InvalidPlacement, match="Partial"):
        P.from_dtensor(spec((4,), (2,), [0], [Partial()]))
    with pytest.raises(InvalidPlacement, match="2 DTensor placements for a 1-dim device mesh"):
        P.from_dtensor(spec((4,), (2,), [0], [Shard(0), Shard(0)]))
    with pytest.raises(InvalidPlacement, match="needs a DTensor"):
        P.from_dtensor(torch.zeros(3))


@pytest.fixture(scope="module")
def gloo_world(tmp_path_factory):
    created = False
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        created = True
    yield
    if created:
        dist.destroy_process_group()


def test_real_dtensor_in_a_world_of_one(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    t = torch.arange(12.0).reshape(4, 3)
    dt = distribute_tensor(t, mesh, [Shard(1)])
    assert P.from_dtensor(dt) == P.Replicated()
    assert P.from_dtensor(dt._spec) == P.Replicated()
    assert P.from_dtensor(distribute_tensor(t, mesh, [Replicate()])) == P.Replicated()
