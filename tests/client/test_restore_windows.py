"""CPU restores in windows (``UCPD_RESTORE_VERIFY=window``): each window of the plan is verified
and then copied while its bytes are in cache. The same bytes as a verify-everything-first
restore, same layout and resharded; a damaged chunk is never copied, the windows before it are.
The default; ``UCPD_RESTORE_VERIFY=all`` and its "targets unchanged" promise: ``tests/corruption``."""

from __future__ import annotations

import pytest
import torch

from helpers import TEST_JOB
from ucpd import knobs
from ucpd.checked import CheckedCopier
from ucpd.errors import ChecksumMismatch
from ucpd.rpc import Connection
from ucpd_client import Checkpointer, placement as P

MiB = 1 << 20


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(6 * MiB // 4, generator=g), "m": torch.randn(512, 1024, generator=g), "s": torch.randn(33, generator=g)}


@pytest.fixture
def ckpt(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "2", flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False, incremental=False) as ck:
        ck.snapshot(1, state()).wait()
        ck.daemon = d
        yield ck


def test_window_mode_restores_the_same_bytes_same_layout_and_resharded_in_many_windows(ckpt, monkeypatch):
    calls = []
    real = CheckedCopier.run_verified
    monkeypatch.setattr(CheckedCopier, "run_verified", lambda self: (calls.append(1), real(self))[1])
    want = state()
    with knobs.override(UCPD_RESTORE_VERIFY="window", UCPD_RESTORE_WINDOW="1M"):
        t = {k: torch.zeros_like(v) for k, v in want.items()}
        ckpt.restore(t)
        assert all(torch.equal(t[k], want[k]) for k in want)
        assert len(calls) >= 8  # 6 MiB + 2 MiB + a little, a window a MiB
        half = {"m": torch.zeros(512, 512)}
        ckpt.restore(half, placements={"m": P.Shard(1, 1, 2)})
        assert torch.equal(half["m"], want["m"][:, 512:])


def flip_in_big(ckpt, at: int) -> None:
    """Flip a bit of the slot's copy of ``big``, ``at`` bytes into it."""
    body = {"rank": 0, "world_size": 1, "job": TEST_JOB,
            "targets": [{"name": "big", "dtype": "float32", "shape": [state()["big"].numel()], "placement": {"kind": "replicated"}}]}
    with Connection(ckpt.daemon.run_dir) as conn:
        reply = conn.call("restore", **body)
        conn.call("release", lease=reply["lease"])
    (src,) = reply["plan"].sources
    with open(src.path, "r+b") as f:
        f.seek(src.offset + at)
        b = f.read(1)
        f.seek(src.offset + at)
        f.write(bytes([b[0] ^ 1]))


def test_window_mode_never_copies_a_damaged_chunk_and_says_which(ckpt):
    want = state()
    flip_in_big(ckpt, 3 * MiB + 5)
    t = {k: torch.full_like(v, 7.0) for k, v in want.items()}
    with knobs.override(UCPD_RESTORE_VERIFY="window", UCPD_RESTORE_WINDOW="1M"):
        with pytest.raises(ChecksumMismatch, match="chunk 3"):
            ckpt.restore(t)
    big = t["big"]
    assert torch.equal(big[: 3 * MiB // 4], want["big"][: 3 * MiB // 4])  # the windows before it
    assert (big[3 * MiB // 4 :] == 7.0).all()  # the damaged chunk and what follows: not written


def test_fused_mode_checks_each_chunk_as_it_copies_and_a_damaged_one_is_an_error(ckpt):
    want = state()
    with knobs.override(UCPD_RESTORE_VERIFY="fused"):
        t = {k: torch.zeros_like(v) for k, v in want.items()}
        ckpt.restore(t)
        assert all(torch.equal(t[k], want[k]) for k in want)
        half = {"m": torch.zeros(512, 512)}
        ckpt.restore(half, placements={"m": P.Shard(1, 0, 2)})
        assert torch.equal(half["m"], want["m"][:, :512])
    flip_in_big(ckpt, 2 * MiB + 5)
    with knobs.override(UCPD_RESTORE_VERIFY="fused"), pytest.raises(ChecksumMismatch, match="chunk 2.*partly written"):
        ckpt.restore({k: torch.zeros_like(v) for k, v in want.items()})


def test_the_knob_refuses_an_unknown_mode():
    with knobs.override(UCPD_RESTORE_VERIFY="sometimes"):
        with pytest.raises(ValueError, match="'window', 'fused' or 'all'"):
            knobs.restore_verify()
