"""On a real GPU: restores into CUDA tensors go from the registered slot to the device (no
pageable copy), column shards by 2-D copies, a damaged source leaves the targets unchanged."""

from __future__ import annotations

import pytest
import torch

from helpers import TEST_JOB
from ucpd import knobs
from ucpd.errors import ChecksumMismatch
from ucpd.rpc import Connection
from ucpd_client import placement as P

MiB = 1 << 20


def state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    return {"big": torch.randn(40 * MiB // 4, device="cuda", generator=g), "m": torch.randn(1024, 2048, device="cuda", generator=g),
            "small": torch.randn(100, device="cuda", generator=g)}


@pytest.mark.parametrize("mode", ["all", "window"])
def test_a_same_layout_restore_into_cuda_tensors_goes_straight_from_the_slot(ckpt, mode):
    want = state()
    ckpt.snapshot(1, want).wait()
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    with knobs.override(UCPD_RESTORE_VERIFY=mode):
        ckpt.restore(out)
    for k in want:
        assert torch.equal(out[k], want[k]), k
    st = ckpt.last_device_restore
    assert st["registered"] >= 1 and st["pageable_bytes"] == 0 and st["staged_bytes"] == 0


def test_a_column_shard_is_restored_by_2d_copies(ckpt):
    want = state()
    ckpt.snapshot(1, want).wait()
    out = {"m": torch.zeros(1024, 1024, device="cuda")}
    ckpt.restore(out, placements={"m": P.Shard(1, 1, 2)})
    assert torch.equal(out["m"], want["m"][:, 1024:])
    assert ckpt.last_device_restore["rows_pieces"] >= 1


def test_a_target_that_is_not_contiguous(ckpt):
    want = state()
    ckpt.snapshot(1, want).wait()
    base = torch.zeros(2048, 1024, device="cuda")
    out = {"m": base.t()}
    ckpt.restore(out)
    assert torch.equal(out["m"], want["m"])


def test_a_damaged_source_leaves_the_cuda_targets_unchanged_when_every_chunk_is_checked_first(ckpt):
    want = state()
    ckpt.snapshot(1, want).wait()
    body = {"rank": 0, "world_size": 1, "job": TEST_JOB,
            "targets": [{"name": "small", "dtype": "float32", "shape": [100], "placement": {"kind": "replicated"}}]}
    with Connection(ckpt.daemon.run_dir) as conn:
        reply = conn.call("restore", **body)
        conn.call("release", lease=reply["lease"])
    (src,) = reply["plan"].sources
    with open(src.path, "r+b") as f:
        f.seek(src.offset + 8)
        b = f.read(1)
        f.seek(src.offset + 8)
        f.write(bytes([b[0] ^ 1]))
    out = {k: torch.full_like(v, 7.0) for k, v in want.items()}
    with pytest.raises(ChecksumMismatch), knobs.override(UCPD_RESTORE_VERIFY="all"):
        ckpt.restore(out)
    assert all((v == 7.0).all() for v in out.values())


def test_ten_thousand_small_tensors_round_trip(ckpt):
    want = {f"t{i}": torch.full((512,), float(i), device="cuda", dtype=torch.float32) for i in range(10_000)}
    ckpt.snapshot(1, want).wait()
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    ckpt.restore(out)
    assert all(torch.equal(out[k], want[k]) for k in list(want)[::97])
