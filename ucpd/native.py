"""Typed wrapper over the C++ extension ``ucpd._native`` (the only module that imports it).

What it offers, all on raw bytes (it never interprets elements):

- parallel memcpy over a persistent thread pool: :func:`copy`, :func:`copy_ptr`, and
  :func:`copy_batch` (many tensors in one call, optionally with per-chunk CRC32C of the source
  computed in the same pass: the snapshot hot path); strided N-D windows (resharding):
  :func:`copy_window` (numpy views) and :func:`copy_strided` (raw addresses); consolidation
  with the CRCs of what is read and of what is written from one pass (the flush):
  :func:`copy_crc_windows`;
- CRC32C (Castagnoli; identical to the ``crc32c`` package): :func:`crc32c`, :func:`crc32c_ptr`,
  :func:`crc32c_combine`, :func:`crc32c_chunks`, :func:`crc32c_chunks_ptr`;
- parity: :func:`xor_parity` (any number of buffers, unequal lengths zero-padded) and a systematic
  Reed-Solomon code over GF(2^8), :func:`rs_encode` / :func:`rs_decode`;
- CUDA staging (only when the extension was built with CUDA and a device is present):
  :func:`cuda_available`, :func:`host_register`, :class:`Stream`, :class:`Event`,
  :func:`pack_d2h`, :func:`unpack_h2d`, :func:`copy_h2d_async`, :func:`copy_h2d_2d_async`,
  :func:`copy_d2h_async`.

Buffers are any object with the buffer protocol that is C- or F-contiguous: numpy arrays,
``bytes``, ``bytearray``, ``mmap``, ``memoryview`` (slices included). Sources may be read-only;
destinations must be writable. ``*_ptr`` variants take raw addresses (``tensor.data_ptr()``,
``ndarray.ctypes.data``) and trust the caller about sizes and lifetimes.

Threading: every function releases the GIL while it works and may be called from any thread,
concurrently; concurrent calls share one pool of worker threads (created once, grown on demand,
never per call). A destination must not be written by anything else during a call. Chunk CRCs
follow the repository convention: chunk *i* covers bytes ``[i*C, min((i+1)*C, nbytes))``.

Errors: bad arguments raise :class:`NativeError` (also a ``ValueError``); CUDA being absent or a
CUDA call failing raises :class:`CudaError` (also a ``RuntimeError``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from ucpd import _native, knobs
from ucpd.errors import UcpdError

__all__ = [
    "CHUNK_BYTES",
    "scatter_crc",
    "scatter_crc_batch",
    "copy_crc_windows",
    "SMALL_COPY_BYTES",
    "NativeError",
    "CudaError",
    "default_threads",
    "copy",
    "copy_ptr",
    "copy_batch",
    "copy_batch_verified",
    "copy_strided",
    "copy_window",
    "crc32c",
    "crc32c_ptr",
    "crc32c_combine",
    "crc32c_chunks",
    "crc32c_chunks_ptr",
    "xor_parity",
    "xor_parity_ptr",
    "rs_encode",
    "rs_decode",
    "rs_parity_matrix",
    "backends",
    "cuda_compiled",
    "cuda_available",
    "cuda_device_count",
    "host_register",
    "host_unregister",
    "Stream",
    "Event",
    "pack_d2h",
    "unpack_h2d",
    "copy_h2d_async",
    "copy_h2d_2d_async",
    "copy_d2h_async",
]

#: Bytes per checksum chunk (the repository-wide convention, see docs/ARCHITECTURE.md).
CHUNK_BYTES: int = 1 << 20  # per-chunk CRCs of snapshots in RAM: a resharded restore re-reads at most a chunk at each edge

#: Default size below which :func:`pack_d2h` / :func:`unpack_h2d` copy an item with the
#: batched kernel instead of one copy-engine transfer each.
SMALL_COPY_BYTES: int = 1 << 20

Buffer = Any  # any object exporting a contiguous buffer (numpy, bytes, bytearray, mmap, memoryview)
StreamLike = Union["Stream", int]


class NativeError(UcpdError, ValueError):
    """Bad arguments to a native kernel (wrong buffer kind, sizes, counts, indices)."""


class CudaError(UcpdError, RuntimeError):
    """CUDA is not compiled in, no device/driver is present, or a CUDA call failed."""


def default_threads() -> int:
    """Threads a call uses when ``threads`` is None.

    ``$UCPD_COPY_THREADS`` if set (a positive integer), else ``min(os.cpu_count(), 8)``.
    Read on every call through ``ucpd.knobs`` (so ``knobs.override(UCPD_COPY_THREADS=...)``
    reaches it), and tests and benchmarks may change the variable at run time.

    Raises:
        NativeError: ``$UCPD_COPY_THREADS`` is not a positive integer.
    """
    env = knobs.get("UCPD_COPY_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise NativeError(f"UCPD_COPY_THREADS must be a positive integer, got {env!r}")
        return n
    return max(1, min(os.cpu_count() or 1, 8))


def _threads(threads: Optional[int]) -> int:
    if threads is None:
        return default_threads()
    if not isinstance(threads, int) or threads < 1:
        raise NativeError(f"threads must be a positive integer or None, got {threads!r}")
    return threads


def _call(fn, *args):
    """Run a _native function, mapping its argument errors to NativeError."""
    try:
        return fn(*args)
    except (ValueError, TypeError, OverflowError, BufferError) as e:
        raise NativeError(str(e)) from e


# ---------------------------------------------------------------------------------------------
# copy


def copy(dst: Buffer, src: Buffer, threads: Optional[int] = None) -> None:
    """Copy all bytes of ``src`` to the start of ``dst``, split across threads.

    Args:
        dst: writable contiguous buffer with at least ``len(src)`` bytes.
        src: contiguous buffer (read-only is fine); must not overlap ``dst``.
        threads: threads to use (None: :func:`default_threads`). Copies under 512 KiB run inline.

    Raises:
        NativeError: a buffer is not contiguous, ``dst`` is read-only or too small.
    """
    _call(_native.copy, dst, src, _threads(threads))


def copy_ptr(dst_ptr: int, src_ptr: int, nbytes: int, threads: Optional[int] = None) -> None:
    """Copy ``nbytes`` from address ``src_ptr`` to ``dst_ptr`` (non-overlapping host memory).

    Raises:
        NativeError: a null pointer with ``nbytes > 0``, or a negative size.
    """
    _call(_native.copy_ptr, dst_ptr, src_ptr, nbytes, _threads(threads))


def copy_batch(
    items: Sequence[tuple[int, int, int]],
    threads: Optional[int] = None,
    crc_chunk: int = 0,
) -> Optional[list[list[int]]]:
    """Copy many ``(dst_ptr, src_ptr, nbytes)`` items in one call, balanced across threads.

    The concatenated bytes of all items are cut into equal tasks: big items are split between
    threads, small ones grouped. With ``crc_chunk=C > 0`` the CRC32C of every C-byte chunk of each
    item's *source* is computed in the same pass (each cache-sized block is checksummed and then
    copied while it is hot in cache).

    Args:
        items: ``(dst_ptr, src_ptr, nbytes)`` tuples; items must not overlap one another's dst.
        threads: threads to use (None: :func:`default_threads`).
        crc_chunk: 0 for no checksums, else the chunk size in bytes (normally ``CHUNK_BYTES``).

    Returns:
        None when ``crc_chunk == 0``; else one list per item of ``ceil(nbytes / crc_chunk)``
        CRC32C values (an empty list for an empty item).

    Raises:
        NativeError: a malformed item, or a null pointer in a non-empty item.
    """
    if crc_chunk < 0:
        raise NativeError(f"crc_chunk must be >= 0, got {crc_chunk}")
    return _call(_native.copy_batch, items, _threads(threads), crc_chunk)


def copy_batch_verified(
    items: Sequence[tuple[int, int, int]],
    expected: Sequence[Sequence[int]],
    chunk: int = CHUNK_BYTES,
    threads: Optional[int] = None,
) -> list[tuple[int, int, int]]:
    """Copy ``(dst_ptr, src_ptr, nbytes)`` items chunk by chunk, checking each ``chunk``-byte
    chunk of a source (from the item's start) against ``expected[item][k]`` *before* copying it,
    while it is in cache: the source is read from RAM once, and a damaged chunk is never
    written (the others are). Chunks are shared across threads; one GIL release.

    Returns:
        ``[(item, chunk, crc found)]`` of the chunks not copied (empty when all matched).

    Raises:
        NativeError: ``chunk <= 0``, a wrong number of CRCs for an item, a malformed item.
    """
    if chunk <= 0:
        raise NativeError(f"chunk must be > 0, got {chunk}")
    return [tuple(b) for b in _call(_native.copy_batch_verified, items, expected, chunk, _threads(threads))]


def scatter_crc(
    dst_ptr: int,
    dst_strides: Sequence[int],
    src_ptr: int,
    shape: Sequence[int],
    itemsize: int,
    chunk: int,
    src_offset: int,
    threads: Optional[int] = None,
) -> tuple[int, list[int]]:
    """Copy a contiguous source range into the strided window ``shape`` at ``dst_ptr`` (element
    strides ``dst_strides``), checksumming the source in the same pass.

    ``src_offset`` is the byte offset of ``src_ptr`` inside its source tensor, whose CRC chunks
    are ``chunk`` bytes from the tensor's start. Returns ``(first, crcs)``: the CRC32C of each
    chunk lying wholly inside the copied range, the first being chunk number ``first``; the
    partial chunks at either edge are not checksummed (verify them separately).

    Raises:
        NativeError: mismatched lengths, negative sizes or strides, a ``chunk`` or ``src_offset``
            that is not a multiple of ``itemsize``, or a null pointer with a non-empty window.
    """
    first, crcs = _call(
        _native.scatter_crc, dst_ptr, list(dst_strides), src_ptr, list(shape), itemsize, chunk, src_offset, _threads(threads)
    )
    return first, list(crcs)


def scatter_crc_batch(
    items: Sequence[tuple[int, Sequence[int], int, Sequence[int], int, int, int]], threads: Optional[int] = None
) -> list[tuple[int, list[int]]]:
    """Many :func:`scatter_crc` calls in one: items are ``(dst_ptr, dst_strides, src_ptr, shape,
    itemsize, chunk, src_offset)``; their chunk-sized pieces share the thread pool. Returns one
    ``(first, crcs)`` per item."""
    return [(f, list(c)) for f, c in _call(_native.scatter_crc_batch, [tuple(i) for i in items], _threads(threads))]


def copy_crc_windows(
    dst_ptr: int,
    dst_nbytes: int,
    dst_origin: int,
    dst_chunk: int,
    sources: Sequence[tuple[int, int, int]],
    copies: Sequence[tuple[int, int, int, Sequence[int], Sequence[int], int]],
    threads: Optional[int] = None,
) -> tuple[list[int], list[int], list[tuple[int, int, int, int]]]:
    """Copy contiguous source ranges into windows of one destination, reading each byte once,
    and return the CRC32C of what was read (by source chunk) and of what was written (by
    destination chunk), both from that one pass.

    Args:
        dst_ptr, dst_nbytes: the destination, contiguous.
        dst_origin, dst_chunk: the destination is cut where ``dst_origin + offset`` is a multiple
            of ``dst_chunk`` (a block of a tensor whose file chunks are ``dst_chunk`` bytes).
        sources: ``(ptr, nbytes, chunk)`` per source: its byte 0, size and CRC chunk size.
        copies: ``(source, src_offset, dst_offset, shape, dst_strides, itemsize)``: the source
            bytes ``[src_offset, src_offset + numel * itemsize)`` into the window ``shape`` at
            element offset ``dst_offset`` and element strides ``dst_strides`` of the destination
            (row-major window order is source order; strides >= 0; windows must not overlap).

    Returns:
        ``(dst_crcs, dst_covered, reads)``: per destination piece ``k`` (``[max(0, k*C - phase),
        min(n, (k+1)*C - phase))``, ``phase = dst_origin % dst_chunk``) the CRC32C of its first
        ``dst_covered[k]`` bytes (the prefix written without a gap: the piece's own CRC when that
        is its length); ``reads``: ``(source, lo, hi, crc)`` for each maximal contiguous byte
        range read inside one chunk of a source, sorted by source and offset.

    Raises:
        NativeError: a window outside its buffer, overlapping windows, bad sizes, strides or
            indices, a zero chunk or item size.
    """
    return _call(
        _native.copy_crc_windows, dst_ptr, dst_nbytes, dst_origin, dst_chunk,
        [tuple(s) for s in sources], [(c[0], c[1], c[2], list(c[3]), list(c[4]), c[5]) for c in copies], _threads(threads),
    )


def copy_strided(
    dst_ptr: int,
    dst_strides: Sequence[int],
    src_ptr: int,
    src_strides: Sequence[int],
    shape: Sequence[int],
    itemsize: int,
    threads: Optional[int] = None,
) -> None:
    """Copy the N-D window ``shape`` from address ``src_ptr`` to ``dst_ptr``.

    Strides are in *elements* of ``itemsize`` bytes (one per dimension, both sides, all >= 0, any
    order: permuted, stepped, broadcast with 0 on the source). Dimensions are reordered and merged
    where contiguous on both sides; the innermost contiguous run is one memcpy, else elements are
    copied one by one. Work is split across threads (rows, or parts of long rows); windows under
    512 KiB run inline. A destination dimension of stride 0 receives its last index (as
    ``np.copyto``); the windows must not overlap each other.

    Args:
        dst_ptr, src_ptr: addresses of element ``(0, ..., 0)``; may be 0 for an empty window.
        dst_strides, src_strides, shape: one int per dimension, at most 16 dimensions.
        itemsize: bytes per element (> 0).
        threads: threads to use (None: :func:`default_threads`).

    Raises:
        NativeError: lengths differ, more than 16 dimensions, a negative size or stride,
            ``itemsize <= 0``, or a null pointer with a non-empty window.
    """
    if itemsize <= 0:
        raise NativeError(f"itemsize must be > 0, got {itemsize}")
    _call(
        _native.copy_strided, dst_ptr, list(dst_strides), src_ptr, list(src_strides), list(shape),
        itemsize, _threads(threads),
    )


def copy_window(dst: np.ndarray, src: np.ndarray, threads: Optional[int] = None) -> None:
    """``dst[...] = src`` for two numpy views of one shape and item size, contiguous or strided.

    The multi-threaded, GIL-free equivalent of ``np.copyto(dst, src)`` without casting or
    broadcasting: bytes are moved, never converted (the dtypes may differ if their item sizes
    agree). Either side may be any view with non-negative strides (slices with steps, column
    shards, transposes, ``as_strided`` windows; 0 strides on ``src``). Byte strides that are not
    multiples of the item size are handled (the copy then works on smaller units).

    Raises:
        NativeError: not numpy arrays, shapes or item sizes differ, ``dst`` is read-only, or a
            negative stride.
    """
    if not isinstance(dst, np.ndarray) or not isinstance(src, np.ndarray):
        raise NativeError(
            f"copy_window: dst and src must be numpy arrays, got {type(dst).__name__} and "
            f"{type(src).__name__}"
        )
    if dst.shape != src.shape:
        raise NativeError(f"copy_window: shapes differ: dst {dst.shape}, src {src.shape}")
    if dst.itemsize != src.itemsize:
        raise NativeError(
            f"copy_window: item sizes differ: dst {dst.itemsize}, src {src.itemsize} bytes"
        )
    if not dst.flags.writeable:
        raise NativeError("copy_window: dst is read-only")
    if dst.size == 0:
        return
    item = dst.itemsize
    shape = list(dst.shape)
    dstr, sstr = list(dst.strides), list(src.strides)
    if any(s < 0 for s in dstr) or any(s < 0 for s in sstr):
        raise NativeError(
            f"copy_window: negative strides are not supported (dst {dst.strides}, src {src.strides})"
        )
    unit = math.gcd(item, *dstr, *sstr)  # strides from as_strided / structured views may be odd
    if unit != item:
        shape.append(item // unit)
        dstr.append(unit)
        sstr.append(unit)
    copy_strided(
        dst.ctypes.data, [s // unit for s in dstr], src.ctypes.data, [s // unit for s in sstr],
        shape, unit, threads,
    )


# ---------------------------------------------------------------------------------------------
# crc32c


def crc32c(buf: Buffer, value: int = 0) -> int:
    """CRC32C of ``buf``, continuing from ``value`` (the CRC of the bytes before it).

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``; equal to ``crc32c.crc32c`` from the PyPI package.

    Raises:
        NativeError: ``buf`` is not a contiguous buffer, or ``value`` is not a 32-bit unsigned int.
    """
    return _call(_native.crc32c, buf, value)


def crc32c_ptr(ptr: int, nbytes: int, value: int = 0) -> int:
    """CRC32C of ``nbytes`` at address ``ptr``, continuing from ``value``."""
    return _call(_native.crc32c_ptr, ptr, nbytes, value)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (O(log len_b))."""
    if len_b < 0:
        raise NativeError(f"len_b must be >= 0, got {len_b}")
    return _call(_native.crc32c_combine, crc_a, crc_b, len_b)


def crc32c_chunks(buf: Buffer, chunk: int = CHUNK_BYTES, threads: Optional[int] = None) -> list[int]:
    """Per-chunk CRC32C of ``buf``, chunks computed in parallel.

    Returns:
        ``ceil(len(buf) / chunk)`` values; value *i* covers ``buf[i*chunk:(i+1)*chunk]``.

    Raises:
        NativeError: ``chunk <= 0`` or ``buf`` is not a contiguous buffer.
    """
    if chunk <= 0:
        raise NativeError(f"chunk must be > 0, got {chunk}")
    return _call(_native.crc32c_chunks, buf, chunk, _threads(threads))


def crc32c_batch(
    items: Sequence[tuple[int, int] | tuple[int, int, int]], chunk: int = 0, threads: Optional[int] = None
) -> list:
    """CRC32C of many ``(ptr, nbytes)`` ranges in one call, their bytes shared across threads.

    ``chunk=0``: one CRC per range, continuing from its third element (the CRC of the bytes
    before it; default 0) -> ``[crc]``. ``chunk=C > 0``: the CRC of every C-byte chunk of each
    range, the first continuing from the range's third element -> ``[[crc, ...]]`` (an empty
    list for an empty range).

    Raises:
        NativeError: a malformed item, or a null pointer in a non-empty one.
    """
    if chunk < 0:
        raise NativeError(f"chunk must be >= 0, got {chunk}")
    return _call(_native.crc32c_batch, items, _threads(threads), chunk)


def crc32c_chunks_ptr(
    ptr: int, nbytes: int, chunk: int = CHUNK_BYTES, threads: Optional[int] = None
) -> list[int]:
    """:func:`crc32c_chunks` over ``nbytes`` at address ``ptr``."""
    if chunk <= 0:
        raise NativeError(f"chunk must be > 0, got {chunk}")
    return _call(_native.crc32c_chunks_ptr, ptr, nbytes, chunk, _threads(threads))


def crc32c_chunks_match(
    items: Sequence[tuple[int, int, Sequence[int]]], chunk: int = CHUNK_BYTES, threads: Optional[int] = None
) -> list[bool]:
    """For each ``(ptr, nbytes, crcs)``: whether every ``chunk``-byte chunk of the ``nbytes`` at
    ``ptr`` has the CRC32C given (``ceil(nbytes / chunk)`` of them). One GIL release and one pass
    over every chunk of every buffer on the pool (small buffers grouped); a buffer's remaining
    chunks are skipped once one differs. Read-only: the incremental snapshot's check.

    Raises:
        NativeError: ``chunk <= 0``, a wrong number of CRCs, or a null pointer with bytes.
    """
    if chunk <= 0:
        raise NativeError(f"chunk must be > 0, got {chunk}")
    return _call(_native.crc32c_chunks_match, [tuple(i) for i in items], chunk, _threads(threads))


# ---------------------------------------------------------------------------------------------
# parity


def xor_parity(out: Buffer, inputs: Sequence[Buffer], threads: Optional[int] = None) -> None:
    """``out = inputs[0] ^ inputs[1] ^ ...`` over ``len(out)`` bytes.

    Inputs may differ in length: a shorter one counts as zero-padded, a longer one is read only
    up to ``len(out)``. With no inputs ``out`` is zeroed. Encoding a group is one call
    (``out`` = parity, sized like the longest member); recovering a lost member is the same call
    with the parity and the survivors (``out`` = the lost member, sized to its own length).
    ``out`` may be one of the inputs itself (same start, at least as long), which XORs the others
    into it in place.

    Raises:
        NativeError: a buffer is not contiguous, ``out`` is read-only, or ``out`` partially
            overlaps an input.
    """
    _call(_native.xor_parity, out, list(inputs), _threads(threads))


def xor_parity_ptr(
    out_ptr: int, out_len: int, inputs: Sequence[tuple[int, int]], threads: Optional[int] = None
) -> None:
    """:func:`xor_parity` on raw addresses: ``inputs`` are ``(ptr, nbytes)`` tuples."""
    _call(_native.xor_parity_ptr, out_ptr, out_len, list(inputs), _threads(threads))


def rs_parity_matrix(k: int, m: int) -> bytes:
    """The m x k Cauchy parity matrix (row-major) used by :func:`rs_encode`.

    Entry ``[i][j] = 1 / ((k + i) XOR j)`` in GF(2^8) with polynomial 0x11d; the full generator is
    ``[I_k ; C]``, so any k of the k + m shards determine the rest.
    """
    return _call(_native.rs_parity_matrix, k, m)


def rs_encode(data: Sequence[Buffer], parity: Sequence[Buffer], threads: Optional[int] = None) -> None:
    """Reed-Solomon encode: fill the ``m = len(parity)`` parity shards from ``k = len(data)``.

    All shards have the same length (pad the last data shard yourself); ``1 <= k``,
    ``1 <= m`` and ``k + m <= 256``. ``parity[i][x] = XOR_j C[i][j] * data[j][x]`` with
    ``C = rs_parity_matrix(k, m)``.

    Raises:
        NativeError: counts out of range, lengths differ, a parity buffer is read-only.
    """
    _call(_native.rs_encode, list(data), list(parity), _threads(threads))


def rs_decode(
    shards: Sequence[Optional[Buffer]],
    k: int,
    m: int,
    out: Optional[Mapping[int, Buffer]] = None,
    threads: Optional[int] = None,
) -> dict[int, Buffer]:
    """Rebuild the missing shards of a Reed-Solomon group.

    Args:
        shards: ``k + m`` entries in encode order (data shards, then parity shards); ``None``
            marks a lost shard. At least ``k`` must be present, all of equal length.
        k, m: the code's data and parity shard counts.
        out: optional ``{index: writable buffer}`` for lost shards (at least the shard length);
            lost shards not in ``out`` get a new ``bytearray``.
        threads: threads to use (None: :func:`default_threads`).

    Returns:
        ``{index: buffer}`` for every lost shard (data and parity), filled.

    Raises:
        NativeError: more than ``m`` shards lost, lengths differ, a bad index or buffer.
    """
    shards = list(shards)
    if len(shards) != k + m:
        raise NativeError(f"rs_decode: got {len(shards)} shards, expected k + m = {k + m}")
    lost = [i for i, s in enumerate(shards) if s is None]
    if len(lost) > m:
        raise NativeError(
            f"rs_decode: {len(lost)} shards lost but the code (k={k}, m={m}) recovers at most {m}"
        )
    out = dict(out or {})
    bad = sorted(set(out) - set(lost))
    if bad:
        raise NativeError(f"rs_decode: out names shards that are present: {bad}")
    if lost:
        length = memoryview(next(s for s in shards if s is not None)).nbytes
        for i in lost:
            if i not in out:
                out[i] = bytearray(length)
    _call(_native.rs_decode, shards, k, m, [(i, out[i]) for i in lost], _threads(threads))
    return {i: out[i] for i in lost}


def backends() -> dict[str, str]:
    """Kernel variants chosen at run time, e.g. ``{"crc32c": "sse4.2", "xor": "avx2", ...}``."""
    return {
        "crc32c": _native.crc32c_backend(),
        "xor": _native.xor_backend(),
        "rs": _native.rs_backend(),
        "cuda": "compiled" if cuda_compiled() else "absent",
    }


# ---------------------------------------------------------------------------------------------
# CUDA


def cuda_compiled() -> bool:
    """True when the extension was built with the CUDA staging part."""
    return bool(_native.cuda_compiled)


def _cuda():
    if not _native.cuda_compiled:
        raise CudaError(
            "ucpd was built without CUDA (no CUDA compiler at build time, or "
            "-DUCPD_WITH_CUDA=OFF); rebuild with nvcc on PATH to stage GPU tensors"
        )
    return _native


def _cuda_call(fn, *args):
    try:
        return fn(*args)
    except RuntimeError as e:
        raise CudaError(str(e)) from e
    except (ValueError, TypeError, OverflowError, BufferError) as e:
        raise NativeError(str(e)) from e


def cuda_available() -> bool:
    """True when CUDA is compiled in and a driver with at least one device is present.

    Never raises; False on machines without a GPU or driver.
    """
    if not _native.cuda_compiled:
        return False
    try:
        return bool(_native.cuda_available())
    except Exception:  # pragma: no cover - the native side already returns False on errors
        return False


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 without CUDA, driver or device)."""
    if not _native.cuda_compiled:
        return 0
    return int(_native.cuda_device_count())


def host_register(ptr: int, nbytes: int, read_only: bool = False) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` (``cudaHostRegister``, portable + mapped),
    so device copies into it are asynchronous DMA and kernels can write it directly.
    ``read_only``: the memory is a read-only mapping that devices only read (a restore source;
    ``cudaHostRegisterReadOnly``).

    Register a long-lived slot once; it stays registered until :func:`host_unregister`.

    Raises:
        CudaError: CUDA absent or the registration failed (e.g. already registered).
    """
    _cuda_call(_cuda().host_register, ptr, nbytes, read_only)


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register` for the range starting at ``ptr``.

    Raises:
        CudaError: CUDA absent or ``ptr`` was not registered.
    """
    _cuda_call(_cuda().host_unregister, ptr)


class Stream:
    """A CUDA stream: owned (created non-blocking on ``device``) or borrowed from a handle.

    ``Stream.from_handle(torch.cuda.current_stream().cuda_stream)`` wraps a torch stream without
    owning it; ``int(stream)`` / ``stream.handle`` gives the raw ``cudaStream_t`` for torch's
    ``torch.cuda.ExternalStream``. Thread-safety: as CUDA streams (any thread may enqueue).
    """

    def __init__(self, device: int = 0, *, _handle: Optional[int] = None):
        lib = _cuda()
        if _handle is None:
            self._handle = _cuda_call(lib.stream_create, device)
            self._owned = True
        else:
            self._handle = int(_handle)
            self._owned = False
        self.device = device

    @classmethod
    def from_handle(cls, handle: int, device: int = 0) -> "Stream":
        """Wrap an existing ``cudaStream_t`` (not destroyed by this object)."""
        return cls(device, _handle=handle)

    @property
    def handle(self) -> int:
        return self._handle

    def __int__(self) -> int:
        return self._handle

    def synchronize(self) -> None:
        """Block until all work queued on the stream has finished."""
        _cuda_call(_native.stream_synchronize, self._handle)

    def query(self) -> bool:
        """True when all work queued on the stream has finished (never blocks)."""
        return bool(_cuda_call(_native.stream_query, self._handle))

    def close(self) -> None:
        """Destroy an owned stream (idempotent; borrowed streams are left alone)."""
        if self._owned and self._handle:
            _native.stream_destroy(self._handle)
        self._handle = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Event:
    """A CUDA event (timing disabled unless ``timing=True``): record on a stream, then wait.

    Thread-safety: as CUDA events.
    """

    def __init__(self, timing: bool = False):
        self._handle = _cuda_call(_cuda().event_create, timing)

    @property
    def handle(self) -> int:
        return self._handle

    def record(self, stream: StreamLike) -> None:
        """Capture the work queued so far on ``stream``."""
        _cuda_call(_native.event_record, self._handle, _stream_handle(stream))

    def synchronize(self) -> None:
        """Block until the captured work has finished."""
        _cuda_call(_native.event_synchronize, self._handle)

    def query(self) -> bool:
        """True when the captured work has finished (never blocks)."""
        return bool(_cuda_call(_native.event_query, self._handle))

    def close(self) -> None:
        if self._handle:
            _native.event_destroy(self._handle)
        self._handle = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _stream_handle(stream: StreamLike) -> int:
    return stream.handle if isinstance(stream, Stream) else int(stream)


def pack_d2h(
    items: Iterable[tuple[int, int, int]],
    dst_base_ptr: int,
    stream: StreamLike,
    small_threshold: int = SMALL_COPY_BYTES,
    dst_nbytes: int = 0,
) -> dict[str, int]:
    """Queue device-to-host copies of many tensors into one page-locked host buffer.

    Items under ``small_threshold`` bytes are packed by ONE kernel launch that writes straight
    into the mapped host buffer (a device-side descriptor table; each block copies its pieces with
    16-byte loads where alignment allows); larger items each go through ``cudaMemcpyAsync`` on the
    copy engine. Kernel and copy-engine work overlap; all of it is ordered after the work already
    on ``stream``, and work queued on ``stream`` afterwards (e.g. an :class:`Event`) waits for all
    of it. Returns as soon as the work is queued.

    Args:
        items: ``(src_device_ptr, dst_offset, nbytes)`` tuples; destinations are
            ``dst_base_ptr + dst_offset`` and must lie in memory registered with
            :func:`host_register` (or allocated pinned).
        dst_base_ptr: host address of the registered buffer.
        stream: a :class:`Stream` or a raw ``cudaStream_t`` (e.g. ``torch_stream.cuda_stream``).
        small_threshold: size under which an item is packed by the kernel.
        dst_nbytes: size of the host buffer; when > 0 every item is checked to lie inside it.

    Returns:
        ``{"kernel_items", "kernel_bytes", "memcpy_items", "memcpy_bytes"}``.

    Raises:
        CudaError: CUDA absent, ``dst_base_ptr`` not registered, or a launch failed.
        NativeError: a malformed item, or one outside ``dst_nbytes``.
    """
    return _cuda_call(
        _cuda().pack_d2h, list(items), dst_base_ptr, _stream_handle(stream), small_threshold,
        dst_nbytes,
    )


def unpack_h2d(
    items: Iterable[tuple[int, int, int]],
    src_base_ptr: int,
    stream: StreamLike,
    small_threshold: int = SMALL_COPY_BYTES,
    src_nbytes: int = 0,
) -> dict[str, int]:
    """The restore direction of :func:`pack_d2h`: items are ``(dst_device_ptr, src_offset,
    nbytes)`` read from the registered host buffer at ``src_base_ptr`` (``src_nbytes`` > 0
    bounds-checks them); same batching rules, same return value and errors."""
    return _cuda_call(
        _cuda().unpack_h2d, list(items), src_base_ptr, _stream_handle(stream), small_threshold,
        src_nbytes,
    )


def copy_h2d_async(dst_dev: int, src_host: int, nbytes: int, stream: StreamLike) -> None:
    """Queue one host-to-device copy (``cudaMemcpyAsync``); asynchronous when the host memory is
    page-locked.

    Raises:
        CudaError: CUDA absent or the copy could not be queued.
    """
    _cuda_call(_cuda().copy_h2d_async, dst_dev, src_host, nbytes, _stream_handle(stream))


def copy_h2d_2d_async(
    dst_dev: int, dst_pitch: int, src_host: int, src_pitch: int, width: int, rows: int, stream: StreamLike
) -> None:
    """Queue one 2-D host-to-device copy (``cudaMemcpy2DAsync``): ``rows`` rows of ``width``
    bytes, ``src_pitch`` bytes apart from ``src_host`` to ``dst_pitch`` apart from ``dst_dev``
    (a column piece of a resharded restore: one call instead of one copy per row).

    Raises:
        NativeError: a pitch smaller than ``width``.
        CudaError: CUDA absent or the copy could not be queued.
    """
    _cuda_call(_cuda().copy_h2d_2d_async, dst_dev, dst_pitch, src_host, src_pitch, width, rows, _stream_handle(stream))


def copy_d2h_async(dst_host: int, src_dev: int, nbytes: int, stream: StreamLike) -> None:
    """Queue one device-to-host copy (``cudaMemcpyAsync``) on the copy engine."""
    _cuda_call(_cuda().copy_d2h_async, dst_host, src_dev, nbytes, _stream_handle(stream))
