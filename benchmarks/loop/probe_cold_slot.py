"""Probe: ways to get a job's first 1 GiB slot ready and copied into (issue 13 item 2, step 1).

    .venv/bin/python benchmarks/loop/probe_cold_slot.py [REPS] [VARIANT ...]

A variant is ``ALLOC/DAEMON/CLIENT``: ALLOC ``falloc`` (posix_fallocate) or ``trunc``
(ftruncate); DAEMON what the daemon does before lending it: ``none``, ``touchN`` (one written
byte per page, N threads), ``madvN`` (MADV_POPULATE_WRITE, N threads); CLIENT how the trainer
maps it: ``pop`` (MAP_POPULATE), ``none`` (the copy faults the pages in), ``madvN``. Then the
copy of the bench_loop state (171 tensors, 2 threads, CRC). ``touch1`` alone is the reference
(what bench_loop calls a first touch). Prints each phase's median (min-max) and total / touch1.
"""
import ctypes, mmap, os, shutil, sys, threading, time, statistics
HERE = os.path.dirname(os.path.abspath(__file__)); ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE), ROOT, os.path.join(ROOT, "client")]
import numpy as np
from bench_loop import State
from ucpd import native

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23
D = f"/dev/shm/ucpd-probe-cold-{os.getpid()}"
os.makedirs(D, exist_ok=True)
st = State(1 << 30)
offs, off = [], 0
for t in st.flat:
    off = (off + 63) // 64 * 64; offs.append(off); off += t.numel() * t.element_size()
SIZE = (off + (2 << 20) - 1) // (2 << 20) * (2 << 20)

def fresh(name, falloc=True):
    p = os.path.join(D, name)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    if falloc: os.posix_fallocate(fd, 0, SIZE)
    else: os.ftruncate(fd, SIZE)
    return p, fd

def touch(fd, threads=1):
    with mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        pages = np.frombuffer(mm, dtype=np.uint8)
        if threads == 1:
            pages[::mmap.PAGESIZE] = 0
        else:
            n = SIZE // threads

            def part(lo, arr=pages):
                arr[lo : lo + n : mmap.PAGESIZE] = 0

            ths = [threading.Thread(target=part, args=(lo,)) for lo in range(0, SIZE, n)]
            [t.start() for t in ths]; [t.join() for t in ths]
        del pages

def populate_madv(addr, threads):
    n = SIZE // threads
    def w(lo):
        r = libc.madvise(addr + lo, n, MADV_POPULATE_WRITE)
        assert r == 0, ctypes.get_errno()
    ths = [threading.Thread(target=w, args=(lo,)) for lo in range(0, SIZE, n)]
    [t.start() for t in ths]; [t.join() for t in ths]

def cmap(path, populate):
    fd = os.open(path, os.O_RDWR)
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    mm = mmap.mmap(fd, SIZE, flags, mmap.PROT_READ | mmap.PROT_WRITE); os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)

def copy(arr):
    base = arr.ctypes.data
    items = [(base + o, t.data_ptr(), t.numel() * t.element_size()) for o, t in zip(offs, st.flat)]
    native.copy_batch(items, threads=2, crc_chunk=native.CHUNK_BYTES)

def daemon_prep(fd, how):
    if how == "none": return
    if how.startswith("touch"): touch(fd, int(how[-1])); return
    mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    a = np.frombuffer(mm, dtype=np.uint8)
    populate_madv(a.ctypes.data, int(how[-1]))
    del a; mm.close()

def variant(name):
    ph = {}
    t0 = time.perf_counter()
    if name == "touch1":
        p, fd = fresh("x"); touch(fd); os.close(fd)
        ph["total"] = time.perf_counter() - t0
    else:
        alloc, dprep, cmapping = name.split("/")
        p, fd = fresh("x", falloc=(alloc == "falloc"))
        ph["alloc"] = time.perf_counter() - t0
        daemon_prep(fd, dprep)
        os.close(fd)
        ph["daemon"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        mm, arr = cmap(p, populate=(cmapping == "pop"))
        if cmapping.startswith("madv"): populate_madv(arr.ctypes.data, int(cmapping[-1]))
        ph["map"] = time.perf_counter() - t1
        t2 = time.perf_counter(); copy(arr); ph["copy"] = time.perf_counter() - t2
        ph["total"] = time.perf_counter() - t0
        t3 = time.perf_counter(); copy(arr); ph["copy2"] = time.perf_counter() - t3
        del arr; mm.close()
    os.unlink(p)
    return ph

names = sys.argv[2:] or ["touch1", "falloc/touch1/pop", "falloc/none/pop", "falloc/none/none", "falloc/none/madv2", "trunc/none/madv2"]
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
res = {n: [] for n in names}
try:
    for r in range(reps):
        for n in names:
            time.sleep(0.3)
            res[n].append(variant(n))
finally:
    shutil.rmtree(D, ignore_errors=True)
ref = statistics.median([x["total"] for x in res["touch1"]]) if "touch1" in res else None
print(f"load {os.getloadavg()[0]:.1f}; SIZE {SIZE>>20} MiB; first touch median {ref*1e3:.0f} ms")
for n in names:
    keys = res[n][0].keys()
    s = "  ".join(f"{k} {statistics.median([x[k] for x in res[n]])*1e3:.0f} ({min(x[k] for x in res[n])*1e3:.0f}-{max(x[k] for x in res[n])*1e3:.0f})" for k in keys)
    tot = [x["total"] / ref for x in res[n]]
    print(f"{n:12s} total/touch {statistics.median(tot):.2f}x ({min(tot):.2f}-{max(tot):.2f})  | {s}")
