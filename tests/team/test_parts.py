"""A part the team receives is checked on arrival, chunk by chunk, through ``ucpd.checked``."""

from __future__ import annotations

import numpy as np
import pytest

from ucpd import native
from ucpd.daemon.manifest import RankPart, TensorEntry
from ucpd.errors import ChecksumMismatch
from ucpd.native import CHUNK_BYTES
from ucpd.team.parts import aligned, check_parts, part_from_wire, used_bytes


def tensor(name: str, data: np.ndarray, offset: int, skipped: bool = False) -> TensorEntry:
    return TensorEntry(name, "uint8", (data.nbytes,), {"kind": "replicated"}, offset, data.nbytes,
                       tuple(native.crc32c_chunks(data, CHUNK_BYTES)), skipped)


@pytest.fixture
def two_ranks():
    """Ranks 0 and 1 laid out one after another (64-byte aligned) in one buffer, as a replica
    file or a part rebuilt from parity holds them; tensor b spans several chunks."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 100, np.uint8), rng.integers(0, 256, 2 * CHUNK_BYTES + 5, np.uint8)
    parts = {0: RankPart(0, -1, [tensor("a", a, 0)], b""), 1: RankPart(1, -1, [tensor("a", a, 0), tensor("b", b, 128)], b"")}
    bases = {0: 0, 1: aligned(used_bytes(parts[0]))}
    buf = bytearray(bases[1] + used_bytes(parts[1]))
    buf[0:100] = a.tobytes()
    buf[bases[1] : bases[1] + 100] = a.tobytes()
    buf[bases[1] + 128 : bases[1] + 128 + b.nbytes] = b.tobytes()
    return buf, bases, parts


def test_sound_parts_pass_and_a_flipped_byte_names_its_rank_tensor_and_chunk(two_ranks):
    buf, bases, parts = two_ranks
    check_parts(buf, bases, parts, "replica of node 3 step 7")
    buf[bases[1] + 128 + CHUNK_BYTES + 1] ^= 0x01  # chunk 1 of rank 1's tensor b
    with pytest.raises(ChecksumMismatch, match=r"replica of node 3 step 7: rank 1 tensor 'b' chunk 1 .*the origin's manifest"):
        check_parts(buf, bases, parts, "replica of node 3 step 7")


def test_a_skipped_tensor_is_not_read(two_ranks):
    buf, bases, parts = two_ranks
    t = parts[1].tensors[1]
    parts[1].tensors[1] = TensorEntry(t.name, t.dtype, t.shape, t.placement, t.offset, t.nbytes, t.crcs, True)
    buf[bases[1] + 128] ^= 0x01
    check_parts(buf, bases, parts, "x")


def test_a_part_off_the_wire_is_the_part_it_describes(two_ranks):
    from ucpd import protocol

    _, _, parts = two_ranks
    p = parts[1]
    back = part_from_wire(protocol.part_to_wire(p, used_bytes(p)))
    assert (back.rank, back.tensors, back.objects) == (p.rank, p.tensors, p.objects)
