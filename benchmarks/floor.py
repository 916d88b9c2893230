"""The memcpy floor's destination: a pre-faulted file on /dev/shm laid out like a slot (tensors
one after another, each at a 64-byte boundary), so that a copy into it is a copy into warm
memory, as a snapshot into a slot used before is.

    buf = SlotLikeBuffer(private_dir(PREFIX, "floor"), [t.numel() * t.element_size() for t in flat])
    items = [(buf.base + off, t.data_ptr(), n) for off, t, n in zip(buf.offsets, flat, sizes)]
    ...
    buf.close()
"""

from __future__ import annotations

import gc
import mmap
import os
import shutil

ALIGN = 64


class SlotLikeBuffer:
    """``sizes`` bytes laid out at ``offsets`` (``total`` in all) in ``folder/floor.bin``, mapped
    (``mm``) and every page written once (``array``: a numpy uint8 view; ``base``: its address).
    :meth:`close` unmaps it and removes ``folder``: drop every view of it first."""

    def __init__(self, folder: str, sizes: list[int]):
        import numpy as np

        self.dir = folder
        self.offsets, off = [], 0
        for n in sizes:
            off = (off + ALIGN - 1) // ALIGN * ALIGN
            self.offsets.append(off)
            off += n
        self.total = off
        fd = os.open(os.path.join(folder, "floor.bin"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, self.total)
        self.mm = mmap.mmap(fd, self.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.array.fill(1)  # every page faulted in once: a warm buffer
        self.base = self.array.ctypes.data

    def close(self) -> None:
        self.array = None
        gc.collect()
        try:
            self.mm.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
