"""Chunked CRC32C through ``ucpd.native`` (imported lazily, so ``ls``/``inspect`` work without it)."""

from __future__ import annotations

from typing import Any


def _native() -> Any:
    from .. import native

    return native


def chunk_crcs(buf: Any, chunk: int, threads: int | None = None) -> list[int]:
    """CRC32C of each ``chunk``-byte piece of ``buf`` (last one short); ``[]`` for no bytes.

    Releases the GIL; ``threads`` native threads (None: ``native.default_threads()``).
    """
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return []
    return list(_native().crc32c_chunks(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, chunk, threads))


def crc32c(buf: Any, value: int = 0) -> int:
    return int(_native().crc32c(buf, value))
