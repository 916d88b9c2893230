"""The data lane over NIXL (``--data-transport nixl``): a ``put``'s and a ``get``'s bytes move
one-sided through NIXL's UCX backend; the TCP lane (``team.lane``) keeps everything else.

``NixlLane`` is a ``DataLane``: same constructor, same public methods, same TCP listener and
handshake (every connection authenticated as there). On a connection it adds six small control
operations (``protocol.LANE_REQUESTS``, served by ``_Serving``): ``nixl_meta`` (our agent's name
and metadata, asked once per peer incarnation), ``nixl_put_begin`` / ``nixl_put_end`` and
``nixl_get`` / ``nixl_get_end`` (a transfer's start and end) and ``nixl_probe``. The side that
asks moves the bytes itself (``_Mover``); they never cross the TCP stream:

- **put**: the sender asks ``nixl_put_begin`` (the fields of a ``put``); the receiver calls
  ``on_put`` (a ``Landing``), registers the destination's memory and answers where it lies
  (``descs``: packed ``<QQ`` address/length pairs, cut where its mappings end), in which
  registrations (``regs``) and their NIXL metadata (``md``, loaded by the sender only for
  registrations it has not seen). The sender WRITEs its views there, then asks ``nixl_put_end``
  (with the payload MAC when on). The receiver checks every chunk of ``landing.chunks`` in one
  pass over the landed bytes (``native.crc32c_batch``: all chunks in one call, spread over the
  pool's threads), then the MAC, tells ``landing.done(ok, bad)`` and answers ``{verified}``.
- **get**: the caller asks ``nixl_get``; the peer calls ``on_get``, registers those views and
  answers where they lie (and their MAC); the caller READs them into its ``into`` views, then
  sends ``nixl_get_end``: the peer holds the views (the mapping stays mapped: a memoryview is
  exported) from the one to the other, as the TCP lane holds them while it sends.
- **probe**: the same as a get, of a scratch buffer: it measures the path the bytes take.

A connection is used by one request at a time, so a transfer's two messages travel on the same
stream: a peer that dies or closes between them cuts that stream (``DaemonUnreachable`` on the
caller's side; the receiver drops what it held, and nothing is reported landed).

**Registrations** (``_Registry``). Memory is registered once per mapping and kept where the
mapping can be told apart from the next one at the same addresses; correctness first, a
registration never outlives its mapping by more than ``SWEEP_S``:

- a view of an ``mmap.mmap`` object (the daemon's slots, replica and fetch files; a numpy array
  on one): the whole map, registered at its first transfer and kept while that object lives,
  is not closed and keeps its size (checked at every use, and by a sweeper every ``SWEEP_S``);
- else a MAP_SHARED mapping of a file found in ``/proc/self/maps``: the whole mapping, kept
  while the maps show it unchanged (addresses, file offset, device, inode), read again at every
  transfer that needs them (~2 ms with a thousand mappings) and by the sweeper;
- else (memory malloc'd by Python or numpy, anonymous or private mappings): the view itself,
  for this transfer only: the allocator may hand those addresses to anything next, with no
  trace in the maps. Measured here (tcp/cma, no RDMA NIC): registering 512 MiB takes 0.3-0.8 ms
  and deregistering 0.1 ms, so this path is cheap too; on an RDMA NIC a registration pins
  pages (far dearer), which is what the cache is for.

A registration still in use when its mapping goes is dropped when that transfer ends (none can:
a transfer holds its views, and an exported mmap cannot be closed). Views are cut where
registrations end, and the two sides' pieces paired one to one (a NIXL descriptor lies in one
registration). (What the maps cannot tell: a file unmapped and mapped again, same file and
offset, at the same addresses between two transfers: the registration then names the same
pages of the same file, right for every host-memory transport and for a pinning RDMA NIC too,
unless the file was truncated in between.)

**Peers** (``_Remotes``). A peer's agent name is unique per incarnation (rank, pid, random):
every begin reply names it, and a name we have not loaded makes us ask ``nixl_meta`` on the same
stream first; a restarted peer thus gets a fresh connection, and the old one is removed once no
transfer uses it. A transfer that fails (or makes no progress for ``IO_TIMEOUT_S`` + its bytes
at ``SLOWEST_BPS``) raises ``DaemonUnreachable`` and the peer's NIXL state is dropped (endpoints
closed, outstanding operations cancelled) and loaded afresh by the next transfer. Every wait is
bounded. We advertise ``nixl://HOST:PORT``: a peer whose address names no ``nixl://`` (a daemon
on the TCP lane: NIXL missing there, or another ``--data-transport``) gets plain ``put`` /
``get`` from us, and we serve its plain ones.

**Checks and trust.** The receiver of a put checks every chunk it names, as the TCP lane does
(the one pass comes after the whole put landed, not as each chunk lands). A get lands where the
caller says; the caller checks it. ``payload_mac`` (``UCPD_PEER_PAYLOAD_MAC=1``) is kept: a keyed
BLAKE2b over the bytes, computed by the side that has them and checked by the other (one more
pass each side). The job's secret gates who learns our descriptors (the TCP handshake), but the
UCX data path itself is not authenticated: a process that reaches the UCX worker and knows a
registration's key could read or write that memory. Use ``--data-transport nixl`` on a fabric
the job trusts (RDMA, a cluster network), not across networks you do not control.

**UCX.** One agent per lane, UCX backend only, NIXL's defaults (``ucx_error_handling_mode=peer``:
transports without peer-failure detection, sysv/posix shm, are not used; same-host bytes go by
cma, others by the best of rc/dc/tcp), the progress thread on (a target is passive only on
transports with hardware RMA; over tcp it must progress) and woken every ``PROGRESS_DELAY_US``
(NIXL's Python API hard-codes 0, a busy loop that takes a core), ``UCX_WORKERS`` workers (and as
many transfers posted at once: threads sharing a worker spin on its lock). ``UCX_TLS``,
``UCX_NET_DEVICES`` and the rest are read from the environment as UCX always does; ``status()``
shows the resources UCX sees. NIXL's own log level defaults to WARN (``NIXL_LOG_LEVEL``).

**Pacing.** ``--net-limit`` is taken from the daemon's bucket by the side that posts the
transfer (``_Mover``: WRITEs of puts sent, READs of gets), in ``PACE_WINDOW`` pieces; the side
that only registered memory moves nothing itself.

Threads: those of ``DataLane``, NIXL's progress thread, and a sweeper (``SWEEP_S``).
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import hmac
import importlib
import itertools
import logging
import mmap
import os
import re
import secrets
import struct
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import msgpack
import numpy as np

from .. import faults, native
from ..errors import AuthError, ChecksumMismatch, DaemonUnreachable, ProtocolError, UcpdError, error_from_code
from ..protocol import LANE_REQUESTS, reply_from_wire, reply_to_wire, validate_fields
from .lane import IO_TIMEOUT_S, PROBE_BYTES, PeerLink, DataLane, Landing, _recv_map, _send_map

log = logging.getLogger("ucpd.team.lane")

SCHEME = "nixl://"
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl_rocm")  # the wheels (never the ``nixl`` meta-package: it may import torch)
PROGRESS_DELAY_US = 100  # NIXL progress thread's pause between rounds (0, NIXL's default, spins a core)
SWEEP_S = 1.0  # the longest a registration outlives its mapping when no transfer looks
SLOWEST_BPS = 50e6  # a transfer may take IO_TIMEOUT_S + its bytes at this rate before it is cut
PACE_WINDOW = 8 << 20  # bytes posted at a time under --net-limit
# UCX workers of the agent, and transfers posted at once: threads sharing one worker spin on its
# lock (4 threads reading 32 MiB each through one worker: 1.7 GB/s here; through 4: 6.3 GB/s; one
# at a time: 4.1 GB/s). 4: the pushes a replication keeps in flight (replicate.PUSH_IN_FLIGHT).
UCX_WORKERS = 4
MAX_REMOTE_REGS = 4096  # a peer's registrations we loaded before its metadata is reloaded afresh
_DESC = struct.Struct("<QQ")
_NIXL_OPS = ("nixl_meta", "nixl_put_begin", "nixl_put_end", "nixl_get", "nixl_get_end", "nixl_probe")
_NIXL_COUNTERS = ("nixl_puts_sent", "nixl_gets_sent", "nixl_registrations", "nixl_deregistrations",
                  "nixl_registered_bytes", "nixl_meta_loaded", "nixl_transfer_failures", "nixl_peers_reset")


class NixlUnavailable(UcpdError):
    """The NIXL data lane cannot start here (NIXL not installed, no UCX backend, agent creation
    failed): the daemon falls back to the TCP lane and says so."""

    code = "nixl_unavailable"


class _TransferFailed(Exception):
    """A NIXL transfer did not complete (peer gone, error state, no progress)."""


def nixl_module():
    """NIXL's Python API module (``nixl_cuXX._api``), or None when no NIXL wheel imports."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # (read at import: NIXL logs every agent made to stdout at INFO)
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    return None


def nixl_missing_reason() -> str:
    errors = []
    for name in NIXL_MODULES:
        try:
            importlib.import_module(f"{name}._api")
            return ""
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    return ("NIXL is not installed (pip install --no-deps nixl-cu12; tried " + "; ".join(errors) + ")")


_LIVE: "weakref.WeakSet[NixlLane]" = weakref.WeakSet()  # closed at exit: NIXL's threads end before the interpreter


@atexit.register
def _close_all() -> None:
    for lane in list(_LIVE):
        try:
            lane.close()
        except Exception:  # (exiting anyway)
            pass


_AGENT_LOCK = threading.Lock()  # the config class is swapped while an agent is made (below)


def _make_agent(api, name: str):
    """A NIXL agent with the UCX backend, its progress thread paced (PROGRESS_DELAY_US) and
    thread-safe for our many threads (NIXL_THREAD_SYNC_RW)."""
    binding = api.nixlBind
    base = binding.nixlAgentConfig

    class _Config(base):  # nixl._api sets pthrDelay = 0 (a busy loop); keep ours
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _AGENT_LOCK:
        binding.nixlAgentConfig = _Config
        try:
            agent = api.nixl_agent(name, api.nixl_agent_config(
                enable_prog_thread=True, backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW))
        finally:
            binding.nixlAgentConfig = base
    if "UCX" not in agent.plugin_list:
        raise NixlUnavailable(f"NIXL has no UCX backend here (plugins: {', '.join(agent.plugin_list) or 'none'})")
    agent.create_backend("UCX", {"num_workers": str(UCX_WORKERS)})
    return agent


def _nixl_errors(api) -> tuple:
    b = api.nixlBind
    return tuple(getattr(b, n) for n in dir(b) if n.endswith("Error") and isinstance(getattr(b, n), type)) + (RuntimeError,)


def _ucx_info() -> dict:
    """UCX's version and the transport resources a context sees under this environment
    (``UCX_TLS`` etc.), read from the libucp NIXL loaded; best effort ({} when it cannot)."""
    out: dict = {}
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libucp" in line and "/" in line})
        if not paths:
            return out
        ucp = ctypes.CDLL(paths[0])
        ucp.ucp_get_version_string.restype = ctypes.c_char_p
        out["ucx_version"] = ucp.ucp_get_version_string().decode()

        class _Params(ctypes.Structure):  # ucp_params_t: field_mask, features, then fields we leave unset
            _fields_ = [("field_mask", ctypes.c_uint64), ("features", ctypes.c_uint64), ("rest", ctypes.c_byte * 512)]

        config, ctx = ctypes.c_void_p(), ctypes.c_void_p()
        if ucp.ucp_config_read(None, None, ctypes.byref(config)) != 0:
            return out
        try:
            major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
            ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
            params = _Params(field_mask=1, features=(1 << 1) | (1 << 6))  # UCP_FEATURE_RMA | UCP_FEATURE_AM
            if ucp.ucp_init_version(major, minor, ctypes.byref(params), config, ctypes.byref(ctx)) != 0:
                return out
            libc = ctypes.CDLL(None)
            libc.fopen.restype = ctypes.c_void_p
            with tempfile.NamedTemporaryFile(prefix="ucpd-ucx-info-") as tmp:
                fp = libc.fopen(tmp.name.encode(), b"w")
                if fp:
                    ucp.ucp_context_print_info(ctx, ctypes.c_void_p(fp))
                    libc.fclose(ctypes.c_void_p(fp))
                text = open(tmp.name).read()
            ucp.ucp_cleanup(ctx)
            out["ucx_resources"] = [line.split("--", 1)[1].strip() for line in text.splitlines()
                                    if "resource" in line and "--" in line]
        finally:
            ucp.ucp_config_release(config)
    except Exception as exc:  # (an ABI we do not know: status says less)
        log.debug("team: could not read UCX's resources: %s", exc)
    return out


# --- memory registrations ------------------------------------------------------------------------------


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if view.nbytes else 0


_HEAP = "heap"  # an owner that is malloc'd memory (no file mapping: nothing to cache)


def _owner(view: memoryview):
    """The ``mmap.mmap`` whose memory ``view`` is (through memoryviews and numpy arrays),
    ``_HEAP`` for memory malloc'd by Python or numpy, None when it cannot tell."""
    obj = view.obj
    for _ in range(16):
        if isinstance(obj, mmap.mmap):
            return obj
        if isinstance(obj, memoryview):
            obj = obj.obj
        elif isinstance(obj, np.ndarray):
            if obj.base is None:
                return _HEAP if obj.flags.owndata else None
            obj = obj.base
        elif isinstance(obj, (bytes, bytearray)):
            return _HEAP
        else:
            return None
    return None


_SHARED_FILE_MAP = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S\S\Ss ([0-9a-f]+) (\S+) (\d+)", re.M)


def _shared_maps() -> tuple[list[int], list[tuple[int, int, tuple]]]:
    """This process's MAP_SHARED mappings of files (shm included), by address: their starts,
    and (start, end, identity) each. (A regular expression keeps the other lines, a thousand in
    a process with NIXL loaded, out of Python: ~2 ms for the read and the scan.)"""
    with open("/proc/self/maps", "rb") as f:
        data = f.read()
    starts, maps = [], []
    for lo, hi, off, dev, inode in _SHARED_FILE_MAP.findall(data):
        if inode != b"0":
            lo, hi = int(lo, 16), int(hi, 16)
            starts.append(lo)
            maps.append((lo, hi, (lo, hi, int(off, 16), dev, int(inode))))
    return starts, maps


@dataclass(eq=False)
class _Reg:
    """One NIXL registration: ``[addr, addr + nbytes)``. Cached ones have a ``key``: ("mmap",
    id) with ``ref`` the mmap object's weak reference, or ("vma", identity) for a shared file
    mapping found in the maps; None: a registration for one transfer."""

    id: int
    addr: int
    nbytes: int
    key: tuple | None
    descs: object  # the nixlRegDList it was registered with
    ref: weakref.ref | None = None
    users: int = 0
    stale: bool = False  # its mapping is gone: deregistered when its last user ends

    def mapped(self) -> bool:
        """Still the live mapping it was registered for (an mmap entry; a vma entry asks the maps)."""
        if self.ref is None:
            return True
        mm = self.ref()
        return mm is not None and not mm.closed and len(mm) == self.nbytes


@dataclass(eq=False)
class _Lease:
    """What one transfer holds: its bytes as (address, length) pieces in order, each inside one
    registration of ``regs``."""

    pieces: list[tuple[int, int]] = field(default_factory=list)
    regs: list[_Reg] = field(default_factory=list)  # one per piece (a registration may hold several)

    def distinct(self) -> list[_Reg]:
        return list(dict.fromkeys(self.regs))


class _Registry:
    """The memory an agent registered with NIXL, cached per mapping where the mapping can be
    told apart from the next one at the same addresses (see the module's docstring):

    - a view of an ``mmap.mmap`` (the daemon's slots, replicas, fetch files; a numpy array on
      one): the whole mmap, kept while that object lives and is not closed;
    - else a MAP_SHARED mapping of a file found in ``/proc/self/maps``: the whole mapping, kept
      while the maps show it unchanged (addresses, offset, device, inode);
    - else (memory malloc'd by Python or numpy, anonymous or private mappings): the view only,
      for this transfer, deregistered when it ends (the allocator may hand those addresses to
      anything next, with no trace in the maps).
    """

    def __init__(self, agent, count):
        self._agent = agent
        self._count = count
        self._lock = threading.Lock()
        self._cached: dict[tuple, _Reg] = {}
        self._live = 0
        self._ids = itertools.count(1)
        self.closed = False

    def acquire(self, views: Sequence[memoryview]) -> _Lease:
        """Registrations covering ``views`` (empty ones skipped), held until ``release``."""
        plan = [(_address(v), v.nbytes, _owner(v)) for v in views if v.nbytes]
        maps = _shared_maps() if any(mm is None for _, _, mm in plan) else None
        lease = _Lease()
        with self._lock:
            if self.closed:
                raise DaemonUnreachable("the data lane is closed")
            self._sweep_locked(maps)
            try:
                for addr, n, mm in plan:
                    if mm is _HEAP:
                        self._place_temp(lease, addr, n)
                    elif mm is not None:
                        self._place_mmap(lease, addr, n, mm)
                    else:
                        self._place_maps(lease, addr, n, maps)
            except BaseException:
                self._release_locked(lease.regs)
                raise
        return lease

    def release(self, lease: _Lease) -> None:
        with self._lock:
            self._release_locked(lease.regs)
            lease.regs = []

    def sweep(self) -> None:
        """Deregister what no mapping holds any more (the sweeper's round)."""
        with self._lock:
            if not self._cached:
                return
            vma = any(k[0] == "vma" for k in self._cached)
        maps = _shared_maps() if vma else None
        with self._lock:
            self._sweep_locked(maps)

    def drop_range(self, addr: int, nbytes: int) -> None:
        """Memory we are about to unmap ourselves: its cached registrations go now."""
        with self._lock:
            for key, reg in list(self._cached.items()):
                if reg.addr < addr + nbytes and addr < reg.addr + reg.nbytes:
                    self._drop_locked(key)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            for key in list(self._cached):
                self._drop_locked(key)
            self._agent = None  # what a transfer still holds goes with the agent

    def metadata(self, agent, regs: Sequence[_Reg]) -> bytes:
        """NIXL's partial metadata of ``regs`` (what a peer needs to reach them)."""
        descs = agent.get_reg_descs([(r.addr, r.nbytes, 0, "") for r in regs], "DRAM")
        return agent.get_partial_agent_metadata(descs, False)

    def status(self) -> dict:
        with self._lock:
            return {"cached": len(self._cached), "cached_bytes": sum(r.nbytes for r in self._cached.values()),
                    "live": self._live}

    # (under self._lock)

    def _place_mmap(self, lease: _Lease, addr: int, n: int, mm: mmap.mmap) -> None:
        key = ("mmap", id(mm))
        reg = self._cached.get(key)
        if reg is not None and (reg.ref() is not mm or not reg.mapped()
                                or not reg.addr <= addr <= addr + n <= reg.addr + reg.nbytes):
            self._drop_locked(key)  # (an id reused by another object, a closed or resized map)
            reg = None
        if reg is None:
            base = _address(memoryview(mm)) if len(mm) else 0
            if not base <= addr <= addr + n <= base + len(mm):
                return self._place_temp(lease, addr, n)
            try:
                reg = self._register(base, len(mm), key)
            except UcpdError:  # (the whole map would not register: a file shorter than its map, say)
                return self._place_temp(lease, addr, n)
            reg.ref = weakref.ref(mm)
            self._cached[key] = reg
        self._use(lease, reg, addr, n)

    def _place_maps(self, lease: _Lease, addr: int, n: int, maps) -> None:
        starts, shared = maps
        end = addr + n
        i = max(bisect.bisect_right(starts, addr) - 1, 0)
        while addr < end:
            while i < len(shared) and shared[i][1] <= addr:
                i += 1
            if i < len(shared) and shared[i][0] <= addr:  # in a shared file mapping: cached whole
                lo, hi, ident = shared[i]
                key = ("vma", ident)
                reg = self._cached.get(key)
                if reg is None:
                    reg = self._cached[key] = self._register(lo, hi - lo, key)
                take = min(end, hi) - addr
                self._use(lease, reg, addr, take)
            else:  # up to the next shared mapping (or the end): for this transfer only
                take = min(end, shared[i][0] if i < len(shared) else end) - addr
                self._place_temp(lease, addr, take)
            addr += take

    def _place_temp(self, lease: _Lease, addr: int, n: int) -> None:
        self._use(lease, self._register(addr, n, None), addr, n)

    def _use(self, lease: _Lease, reg: _Reg, addr: int, n: int) -> None:
        reg.users += 1
        lease.regs.append(reg)
        lease.pieces.append((addr, n))

    def _register(self, addr: int, nbytes: int, key) -> _Reg:
        agent = self._agent
        if agent is None:
            raise DaemonUnreachable("the data lane is closed")
        try:
            descs = agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
        except Exception as exc:
            raise UcpdError(f"NIXL could not register {nbytes} bytes at {addr:#x}: {type(exc).__name__}: {exc}") from None
        self._live += 1
        self._count(nixl_registrations=1, nixl_registered_bytes=nbytes)
        return _Reg(next(self._ids), addr, nbytes, key, descs)

    def _deregister(self, reg: _Reg) -> None:
        self._live -= 1
        agent = self._agent
        if agent is None:  # (closed: the agent frees what is left when it goes)
            return
        try:
            agent.deregister_memory(reg.descs)
        except Exception as exc:  # (NIXL frees what it can; nothing of ours refers to it any more)
            log.warning("team: NIXL could not deregister %d bytes at %#x: %s", reg.nbytes, reg.addr, exc)
        self._count(nixl_deregistrations=1)

    def _drop_locked(self, key: tuple) -> None:
        reg = self._cached.pop(key)
        reg.stale = True
        if reg.users == 0:
            self._deregister(reg)

    def _release_locked(self, regs: list[_Reg]) -> None:
        for reg in regs:
            reg.users -= 1
            if reg.users == 0 and (reg.key is None or reg.stale):
                self._deregister(reg)

    def _sweep_locked(self, maps) -> None:
        live = {m[2] for m in maps[1]} if maps is not None else None
        for key, reg in list(self._cached.items()):
            if key[0] == "mmap" and not reg.mapped():
                self._drop_locked(key)
            elif key[0] == "vma" and live is not None and key[1] not in live:
                self._drop_locked(key)


def _check_chunks(items: Sequence[tuple[memoryview, Sequence[tuple[int, int, int]]]]) -> tuple[list[int], list[int]]:
    """CRC32C of every ``(start, end, crc)`` chunk of every ``(view, chunks)``, in one call
    (``native.crc32c_batch``: one pass, over the pool's threads); (indexes that matched, that
    did not), counted across the items in order."""
    ranges, want = [], []
    for view, chunks in items:
        base = _address(view)
        for start, end, crc in chunks:
            if not 0 <= start <= end <= view.nbytes:
                raise ProtocolError(f"a chunk [{start}, {end}) outside its view of {view.nbytes} bytes")
            ranges.append((base + start, end - start))
            want.append(crc & 0xFFFFFFFF)
    ok: list[int] = []
    bad: list[int] = []
    for i, (got, crc) in enumerate(zip(native.crc32c_batch(ranges) if ranges else [], want)):
        (ok if got == crc else bad).append(i)
    return ok, bad


def _pack_descs(pieces: Sequence[tuple[int, int]]) -> bytes:
    return b"".join(_DESC.pack(a, n) for a, n in pieces)


def _unpack_descs(blob: bytes, nbytes: int, what: str) -> list[tuple[int, int]]:
    if len(blob) % _DESC.size:
        raise ProtocolError(f"{what}: descriptors of {len(blob)} bytes (not a multiple of {_DESC.size})")
    pieces = [p for p in _DESC.iter_unpack(blob) if p[1]]
    if sum(n for _, n in pieces) != nbytes:
        raise ProtocolError(f"{what}: descriptors of {sum(n for _, n in pieces)} bytes for a transfer of {nbytes}")
    return pieces


def _pair(local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]):
    """Cut two piece lists of the same bytes where either has a boundary: NIXL pairs
    descriptors one to one, of equal lengths. (No merging: two pieces contiguous in memory may
    lie in two registrations, and a descriptor must lie in one.)"""
    out_l: list[tuple[int, int]] = []
    out_r: list[tuple[int, int]] = []
    i = j = di = dj = 0
    while i < len(local) and j < len(remote):
        (la, ln), (ra, rn) = local[i], remote[j]
        n = min(ln - di, rn - dj)
        out_l.append((la + di, n))
        out_r.append((ra + dj, n))
        di, dj = di + n, dj + n
        if di == ln:
            i, di = i + 1, 0
        if dj == rn:
            j, dj = j + 1, 0
    return out_l, out_r


def _windows(local, remote, window: int):
    """(local, remote) descriptor lists of at most ``window`` bytes each."""
    if window <= 0:
        yield local, remote
        return
    wl, wr, size = [], [], 0
    for (la, n), (ra, _) in zip(local, remote):
        at = 0
        while at < n:
            take = min(n - at, window - size)
            wl.append((la + at, take))
            wr.append((ra + at, take))
            size, at = size + take, at + take
            if size == window:
                yield wl, wr
                wl, wr, size = [], [], 0
    if wl:
        yield wl, wr


# --- peers (the caller's side) -------------------------------------------------------------------------


class _PeerError(Exception):
    """The peer answered a typed error (the stream is still in step)."""

    def __init__(self, error: UcpdError):
        super().__init__(str(error))
        self.error = error


def _request(sock, body: dict) -> dict:
    """One control operation on ``sock``: its reply, or ``_PeerError`` with the typed error."""
    spec = LANE_REQUESTS[body["op"]]
    validate_fields(spec.name, {k: v for k, v in body.items() if k != "op"}, spec.required, spec.optional)
    _send_map(sock, body)
    msg = _recv_map(sock)
    if "e" in msg:
        code, text = msg["e"]
        raise _PeerError(error_from_code(code, text))
    return reply_from_wire(spec, msg.get("r"))


@dataclass(eq=False)
class _Remote:
    """A peer's NIXL agent as loaded here (one per peer incarnation)."""

    name: str
    node: int
    regs: set = field(default_factory=set)
    users: int = 0
    dead: bool = False  # being dropped: removed from NIXL when its last transfer ends


class _Remotes:
    """The peers' NIXL agents loaded into ours (see **Peers** in the module's docstring): one
    per peer incarnation, loaded when a reply first names it, in use while transfers hold it,
    retired when it fails, restarts or is forgotten, and removed from NIXL once unused."""

    def __init__(self, agent, errors: tuple, count):
        self._agent = agent
        self._errors = errors
        self._count = count
        self._nx = threading.Condition()
        self._by_name: dict[str, _Remote] = {}
        self._node_agent: dict[int, str] = {}

    def __len__(self) -> int:
        with self._nx:
            return len(self._by_name)

    def load(self, dest: int, sock, reply: dict) -> _Remote:
        """The peer's agent that ``reply`` names, loaded (with its metadata asked on ``sock`` if
        new) and with the registrations the reply uses; marked in use until ``unuse``."""
        name, regs = reply["agent"], set(reply["regs"])
        deadline = time.monotonic() + IO_TIMEOUT_S
        with self._nx:
            while True:
                rem = self._by_name.get(name)
                if rem is None or not rem.dead:
                    break
                if not self._nx.wait(max(0.0, deadline - time.monotonic())):  # its last transfer ends first
                    raise _TransferFailed(f"node {dest}'s NIXL agent is still in use by a failed transfer")
            if rem is not None:
                rem.users += 1
        agent = self._agent
        if agent is None:
            raise DaemonUnreachable("the data lane is closed")
        if rem is None:
            meta = _request(sock, {"op": "nixl_meta"})
            if meta["agent"] != name:
                raise ProtocolError(f"node {dest} named NIXL agent {meta['agent']!r}, then {name!r}")
            try:
                agent.add_remote_agent(meta["md"])
            except self._errors as exc:
                raise _TransferFailed(f"cannot load node {dest}'s NIXL metadata: {type(exc).__name__}: {exc}") from None
            self._count(nixl_meta_loaded=1)
            with self._nx:
                rem = self._by_name.get(name)
                if rem is None:
                    rem = self._by_name[name] = _Remote(name, dest)
                rem.users += 1
                old = self._node_agent.get(dest)
                self._node_agent[dest] = name
                if old and old != name and old in self._by_name:
                    self._retire_locked(self._by_name[old])  # the peer restarted
        try:
            if not regs <= rem.regs:
                agent.add_remote_agent(reply["md"])
                with self._nx:
                    rem.regs |= regs
        except self._errors as exc:
            self.unuse(rem)
            raise _TransferFailed(f"cannot load node {dest}'s registrations: {type(exc).__name__}: {exc}") from None
        except BaseException:
            self.unuse(rem)
            raise
        return rem

    def unuse(self, rem: _Remote) -> None:
        with self._nx:
            rem.users -= 1
            if len(rem.regs) > MAX_REMOTE_REGS:
                self._retire_locked(rem)  # stale sections pile up in NIXL: start afresh when idle
            elif rem.dead and rem.users == 0:
                self._remove_locked(rem)

    def retire(self, rem: _Remote) -> None:
        with self._nx:
            self._retire_locked(rem)

    def forget(self, node: int) -> None:
        """``node``'s agent is retired (a new incarnation, or none that speaks NIXL)."""
        with self._nx:
            name = self._node_agent.pop(node, None)
            rem = self._by_name.get(name) if name else None
            if rem is not None:
                self._retire_locked(rem)

    def close(self) -> None:
        with self._nx:
            for rem in list(self._by_name.values()):
                self._retire_locked(rem)
        self._agent = None

    def _retire_locked(self, rem: _Remote) -> None:
        rem.dead = True
        if self._node_agent.get(rem.node) == rem.name:
            del self._node_agent[rem.node]
        if rem.users == 0:
            self._remove_locked(rem)

    def _remove_locked(self, rem: _Remote) -> None:
        if self._by_name.get(rem.name) is rem:
            del self._by_name[rem.name]
            agent = self._agent
            if agent is not None:
                try:
                    agent.remove_remote_agent(rem.name)
                except Exception as exc:  # (already gone)
                    log.debug("team: NIXL could not remove agent %s: %s", rem.name, exc)
            self._count(nixl_peers_reset=1)
        self._nx.notify_all()


# --- transfers (the caller's side) ---------------------------------------------------------------------


class _Mover:
    """Moves a transfer's bytes, on the side that posts it: our views registered and cut to pair
    with the peer's pieces, posted as NIXL WRITEs or READs (in ``PACE_WINDOW`` pieces taken from
    the daemon's bucket under ``--net-limit``; at most ``UCX_WORKERS`` at once), each polled to
    completion or its deadline, cancelled otherwise. A failed transfer retires the peer's agent."""

    def __init__(self, agent, errors: tuple, registry: _Registry, remotes: _Remotes, bucket):
        self._agent = agent
        self._errors = errors
        self._registry = registry
        self._remotes = remotes
        self._bucket = bucket
        self._posting = threading.BoundedSemaphore(UCX_WORKERS)

    def close(self) -> None:
        self._agent = None

    def move(self, dest: int, sock, reply: dict, op: str, views: Sequence[memoryview], nbytes: int) -> None:
        """WRITE ``views`` to, or READ them from, the peer's memory ``reply`` describes."""
        agent = self._agent
        if agent is None:
            raise DaemonUnreachable("the data lane is closed")
        remote = _unpack_descs(reply["descs"], nbytes, f"node {dest}'s {op.lower()} descriptors")
        if not nbytes:
            return
        rem = self._remotes.load(dest, sock, reply)
        lease = None
        try:
            lease = self._registry.acquire(views)
            local, far = _pair(lease.pieces, remote)
            window = PACE_WINDOW if self._bucket.rate > 0 else 0
            for wl, wr in _windows(local, far, window):
                self._pace(sum(n for _, n in wl))
                self.post(agent, op, wl, wr, rem)
        except _TransferFailed:
            self._remotes.retire(rem)  # its endpoints may be broken: load it afresh next time
            raise
        finally:
            if lease is not None:
                self._registry.release(lease)
            self._remotes.unuse(rem)

    def post(self, agent, op: str, local, remote, rem: _Remote) -> None:
        """One window: posted, then polled until it completes (``_TransferFailed`` otherwise)."""
        nbytes = sum(n for _, n in local)
        deadline = time.monotonic() + IO_TIMEOUT_S + nbytes / SLOWEST_BPS
        if not self._posting.acquire(timeout=IO_TIMEOUT_S):
            raise _TransferFailed(f"{UCX_WORKERS} transfers have been in flight for {IO_TIMEOUT_S:.0f} s")
        handle = None
        try:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM"),
                                           agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM"), rem.name)
            state = agent.transfer(handle)
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise _TransferFailed(f"no completion of {nbytes} bytes in {IO_TIMEOUT_S + nbytes / SLOWEST_BPS:.0f} s")
                if pause:
                    time.sleep(pause)
                pause = min(max(pause * 2, 20e-6), 1e-3)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise _TransferFailed(f"NIXL reports the {op} in state {state}")
        except self._errors as exc:
            raise _TransferFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            if handle is not None:
                try:
                    handle.release()
                except Exception as exc:  # (NIXL could not cancel it: it keeps the handle; the peer is dropped)
                    log.info("team: NIXL kept a transfer it could not cancel: %s", exc)
            self._posting.release()

    def _pace(self, nbytes: int) -> None:
        self._bucket.acquire(nbytes)


# --- serving (a thread per connection) -----------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    """A transfer a connection began and has not ended (the serving side)."""

    kind: str  # "put" | "get"
    token: int
    lease: _Lease
    landing: Landing | None = None
    views: list | None = None
    step: int = 0
    nbytes: int = 0
    src: int = 0
    scratch: mmap.mmap | None = None  # a probe's buffer, unmapped when it ends
    scratch_addr: int = 0


class _Serving:
    """The serving side of the ``nixl_*`` operations: a begin asks ``on_put`` / ``on_get``,
    registers that memory and answers where it lies, and the connection holds it until the end
    (or the connection itself) ends it; a put's end checks the landed bytes and reports them.

    ``count``, ``tally(src, received=, sent=)`` and ``error(sock, exc)`` are the lane's books
    and its typed error answer."""

    def __init__(self, rank: int, api, agent, agent_name: str, errors: tuple, registry: _Registry, *, on_put, on_get,
                 payload_mac: bool, digest, count, tally, error):
        self._rank = rank
        self._api, self._agent, self._agent_name, self._errors = api, agent, agent_name, errors
        self._registry = registry
        self._on_put, self._on_get = on_put, on_get
        self._payload_mac, self._digest = payload_mac, digest
        self._count, self._tally, self._error = count, tally, error
        self._pending: dict[object, _Pending] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)

    def answer(self, sock, src: int, body: dict) -> bool:
        """Serve one ``nixl_*`` request; False when the stream is out of step."""
        op = body["op"]
        spec = LANE_REQUESTS[op]
        try:
            b = validate_fields(op, {k: v for k, v in body.items() if k != "op"}, spec.required, spec.optional)
        except UcpdError as exc:
            self._count(malformed=1)
            _send_map(sock, {"e": [exc.code, str(exc)]})
            return True
        agent = self._agent
        if agent is None:
            return self._error(sock, DaemonUnreachable(f"node {self._rank}'s data lane is closing"))
        try:
            if op == "nixl_meta":
                binding = self._api.nixlBind  # no registrations: the connection's part only
                md = agent.get_partial_agent_metadata(binding.nixlRegDList(binding.DRAM_SEG), True)
                _send_map(sock, {"r": reply_to_wire(spec, {"agent": self._agent_name, "md": md})})
                return True
            if op == "nixl_put_begin":
                return self._put_begin(sock, src, spec, b, agent)
            if op == "nixl_put_end":
                return self._put_end(sock, src, spec, b)
            if op in ("nixl_get", "nixl_probe"):
                return self._get_begin(sock, src, spec, b, agent, probe=op == "nixl_probe")
            return self._get_end(sock, src, spec, b)
        except UcpdError as exc:
            return self._error(sock, exc)
        except self._errors as exc:
            return self._error(sock, UcpdError(f"node {self._rank}'s NIXL failed: {type(exc).__name__}: {exc}"))

    def drop(self, sock) -> None:
        """``sock``'s connection ended: what it began and did not end goes, nothing reported landed."""
        with self._lock:
            pending = self._pending.pop(sock, None)
        if pending is not None:
            self._end(pending)

    def close(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            self._end(p)
        self._agent = None

    def _hold(self, sock, pending: _Pending) -> None:
        with self._lock:
            old = self._pending.pop(sock, None)
            self._pending[sock] = pending
        if old is not None:  # a begin without its end: the caller gave up on it
            self._end(old)

    def _take(self, sock, kind: str, token: int) -> _Pending:
        with self._lock:
            pending = self._pending.get(sock)
            if pending is None or pending.kind != kind or pending.token != token:
                raise ProtocolError(f"a nixl_{kind}_end for no {kind} begun on this connection (token {token})")
            del self._pending[sock]
        return pending

    def _end(self, p: _Pending) -> None:
        self._registry.release(p.lease)
        p.landing = None
        if p.views is not None:
            for v in p.views:
                v.release()
            p.views = None
        if p.scratch is not None:
            self._registry.drop_range(p.scratch_addr, len(p.scratch))
            p.scratch.close()
            p.scratch = None

    def _put_begin(self, sock, src: int, spec, b: dict, agent) -> bool:
        nbytes = b["nbytes"]
        landing = self._on_put(src, dict(b, mac=None))  # (the fields of a put)
        if landing.dst.nbytes != nbytes:
            raise ProtocolError(f"a put of {nbytes} bytes for a destination of {landing.dst.nbytes}")
        dst = memoryview(landing.dst).cast("B")
        if dst.readonly:
            raise ProtocolError("a put's destination is read-only")
        lease = self._registry.acquire([dst])
        token = next(self._tokens)
        pending = _Pending("put", token, lease, landing=landing, step=b["step"], nbytes=nbytes, src=src)
        try:
            md = self._registry.metadata(agent, lease.distinct()) if lease.regs else b""
        except BaseException:
            self._end(pending)
            raise
        self._hold(sock, pending)
        _send_map(sock, {"r": reply_to_wire(spec, {"token": token, "agent": self._agent_name,
                                                   "descs": _pack_descs(lease.pieces),
                                                   "regs": [r.id for r in lease.distinct()], "md": md})})
        return True

    def _put_end(self, sock, src: int, spec, b: dict) -> bool:
        p = self._take(sock, "put", b["token"])
        try:
            if faults.once("lane.cut.put", p.step):  # (a test's fault: the stream breaks before the check)
                raise ConnectionResetError("the data lane was cut mid-put (fault injected)")
            done, nbytes = p.landing.done, p.nbytes
            ok, bad = self._check(p.landing, b.get("mac"))
        finally:
            self._end(p)  # (the destination's view goes before we answer: its owner may unmap it then)
            del p
        self._count(puts_received=1, bytes_received=nbytes, chunks_verified=len(ok), checksum_errors=len(bad))
        self._tally(src, received=nbytes)
        if done is not None:
            try:
                done(ok, bad)
            except UcpdError as exc:
                return self._error(sock, exc)
        _send_map(sock, {"r": reply_to_wire(spec, {"verified": len(ok)})})
        return True

    def _check(self, landing: Landing, mac: bytes | None) -> tuple[list[int], list[int]]:
        """Every chunk of ``landing`` checked over the landed bytes, in one pass; then the MAC."""
        dst = memoryview(landing.dst).cast("B")
        chunks = list(landing.chunks)
        ok, bad = _check_chunks([(dst, chunks)])
        if self._payload_mac and not hmac.compare_digest(self._digest([dst]), mac or b""):
            self._count(auth_failures=1)
            return [], list(range(len(chunks))) or [-1]
        return ok, bad

    def _get_begin(self, sock, src: int, spec, b: dict, agent, probe: bool) -> bool:
        scratch, scratch_addr = None, 0
        if probe:
            scratch = mmap.mmap(-1, max(b["nbytes"], 1))  # MAP_SHARED anonymous (zeros)
            views = [memoryview(scratch)[: b["nbytes"]]]
            scratch_addr = _address(views[0])
            step = -1
        else:
            views = [memoryview(v).cast("B") for v in self._on_get(src, b)]
            step = b["step"]
        nbytes = sum(v.nbytes for v in views)
        try:
            lease = self._registry.acquire(views)
        except BaseException:
            for v in views:
                v.release()
            if scratch is not None:
                scratch.close()
            raise
        token = next(self._tokens)
        pending = _Pending("get", token, lease, views=views, step=step, nbytes=nbytes, src=src, scratch=scratch,
                           scratch_addr=scratch_addr)
        try:
            reply = {"token": token, "agent": self._agent_name, "nbytes": nbytes, "descs": _pack_descs(lease.pieces),
                     "regs": [r.id for r in lease.distinct()],
                     "md": self._registry.metadata(agent, lease.distinct()) if lease.regs else b""}
            if self._payload_mac and not probe:
                reply["mac"] = self._digest(views)
        except BaseException:
            self._end(pending)
            raise
        self._hold(sock, pending)
        _send_map(sock, {"r": reply_to_wire(spec, reply)})
        if not probe and faults.once("lane.cut.get", step):  # (a test's fault: the stream breaks mid-get)
            raise ConnectionResetError("the data lane was cut mid-get (fault injected)")
        return True

    def _get_end(self, sock, src: int, spec, b: dict) -> bool:
        p = self._take(sock, "get", b["token"])
        probe = p.scratch is not None
        self._end(p)
        if not probe:
            self._count(gets_answered=1, bytes_sent=p.nbytes)
            self._tally(src, sent=p.nbytes)
        _send_map(sock, {"r": reply_to_wire(spec, {})})
        return True


# --- the lane ------------------------------------------------------------------------------------------


class NixlLane(DataLane):
    """``DataLane`` whose puts and gets move through NIXL (see the module's docstring). Same
    constructor; ``start()`` raises ``NixlUnavailable`` when NIXL cannot run here."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.counters.update(dict.fromkeys(_NIXL_COUNTERS, 0))
        self._agent_name = ""
        self._registry: _Registry | None = None
        self._remotes: _Remotes | None = None
        self._mover: _Mover | None = None
        self._serving: _Serving | None = None
        self._ucx: dict = {}
        self._speaks: dict[int, bool] = {}  # peer node -> its address says nixl://
        self._sweeper: threading.Thread | None = None

    # --- life cycle ------------------------------------------------------------------------------

    def start(self) -> str:
        """Make the NIXL agent, then bind and serve as ``DataLane.start``; returns
        ``nixl://HOST:PORT``. Raises ``NixlUnavailable`` (nothing bound) when NIXL cannot run."""
        api = nixl_module()
        if api is None:
            raise NixlUnavailable(nixl_missing_reason() or "NIXL is not installed (pip install --no-deps nixl-cu12)")
        name = f"ucpd-{self.rank}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            agent = _make_agent(api, name)
        except NixlUnavailable:
            raise
        except Exception as exc:
            tls = os.environ.get("UCX_TLS")
            hint = (f" (UCX_TLS={tls}: it needs a transport for active messages too, e.g. UCX_TLS=cma,tcp)"
                    if tls else "")
            raise NixlUnavailable(f"NIXL could not start its UCX backend: {type(exc).__name__}: {exc}{hint}") from None
        self._agent_name = name
        errors = _nixl_errors(api)
        self._registry = _Registry(agent, self._count)
        self._remotes = _Remotes(agent, errors, self._count)
        self._mover = _Mover(agent, errors, self._registry, self._remotes, self._bucket)
        self._serving = _Serving(self.rank, api, agent, name, errors, self._registry,
                                 on_put=lambda src, b: self._on_put(src, b),  # (looked up at each call: replaceable)
                                 on_get=lambda src, b: self._on_get(src, b), payload_mac=self.payload_mac,
                                 digest=self._digest, count=self._count, tally=self._tally, error=self._error)
        self._ucx = _ucx_info()
        try:
            address = super().start()
        except BaseException:
            self._teardown()
            raise
        self.address = SCHEME + address
        _LIVE.add(self)
        self._sweeper = threading.Thread(target=self._sweep_loop, name=f"ucpd-lane-nixl-sweep-{self.rank}", daemon=True)
        self._sweeper.start()
        log.info("team: data lane over NIXL/UCX (agent %s, UCX %s, resources %s)", name,
                 self._ucx.get("ucx_version", "?"), ", ".join(self._ucx.get("ucx_resources", [])) or "?")
        return self.address

    def close(self) -> None:
        super().close()
        self._teardown()

    def _teardown(self) -> None:
        # each drops its reference to the agent, which goes with the last one (a thread still
        # inside a call keeps it)
        for part in (self._serving, self._remotes, self._mover, self._registry):
            if part is not None:
                part.close()

    def _sweep_loop(self) -> None:
        while not self._closed:
            time.sleep(SWEEP_S)
            reg = self._registry
            if reg is None or self._closed:
                return
            try:
                reg.sweep()
            except Exception as exc:  # (the next transfer sweeps too)
                log.debug("team: NIXL registration sweep failed: %s", exc)

    # --- peers -----------------------------------------------------------------------------------

    def set_peer(self, node: int, address: str | None) -> None:
        speaks = bool(address) and address.startswith(SCHEME)
        with self._lock:
            link = self.peers.get(node)
            before = link.address if link is not None else None
        super().set_peer(node, address)
        with self._lock:
            after = self.peers[node].address
        self._speaks[node] = speaks
        if before != after or not speaks:  # (a new incarnation, or one on the TCP lane now)
            self._forget_agent(node)

    def forget(self, node: int) -> None:
        super().forget(node)
        self._forget_agent(node)

    def _forget_agent(self, node: int) -> None:
        if self._remotes is not None:
            self._remotes.forget(node)

    def status(self) -> dict:
        st = super().status()
        st["transport"] = "nixl"
        remotes = len(self._remotes) if self._remotes is not None else 0
        uses = self._ucx.get("ucx_resources")
        st["nixl"] = {"agent": self._agent_name, "backend": "UCX", "ucx_version": self._ucx.get("ucx_version"),
                      "ucx_tls": os.environ.get("UCX_TLS") or "UCX default (every transport found)",
                      "ucx_resources": uses, "error_handling": "peer (transports without peer failure detection unused)",
                      "ucx_workers": UCX_WORKERS, "progress_delay_us": PROGRESS_DELAY_US, "peers_loaded": remotes,
                      "registrations": self._registry.status() if self._registry is not None else None}
        for p in st["peers"]:
            nixl = self._speaks.get(p["node"], False)
            p["transport"] = "nixl" if nixl else "tcp"
            if nixl and p.get("path"):
                p["path"] = f"nixl/ucx (control: {p['path']})"
        return st

    # --- requests (any thread) -------------------------------------------------------------------

    def put(self, dest: int, body: dict, views: Sequence[memoryview]) -> dict:
        if not self._speaks.get(dest):
            return super().put(dest, body, views)
        views = [memoryview(v).cast("B") for v in views]
        nbytes = sum(v.nbytes for v in views)
        begin = dict(body, op="nixl_put_begin", nbytes=nbytes)
        end = {"op": "nixl_put_end"}
        if self.payload_mac:
            end["mac"] = self._digest(views)
        t0 = time.monotonic()

        def transfer(sock, reply):
            self._mover.move(dest, sock, reply, "WRITE", views, nbytes)
            end["token"] = reply["token"]
            return _request(sock, end)

        reply = self._session(dest, begin, transfer)
        self._count(puts_sent=1, nixl_puts_sent=1, bytes_sent=nbytes)
        self._observe(dest, nbytes, time.monotonic() - t0, sent=True)
        return reply

    def get(self, dest: int, body: dict, into: Sequence[memoryview], checks=None) -> None:
        """As ``DataLane.get``; ``checks`` (per view, ``(start, end, crc32c)`` chunks) are
        checked once every byte landed, in one pass (ChecksumMismatch if one fails)."""
        if not self._speaks.get(dest):
            return super().get(dest, body, into, checks)
        into = [memoryview(v).cast("B") for v in into]
        nbytes = sum(v.nbytes for v in into)
        t0 = time.monotonic()

        def transfer(sock, reply):
            if reply["nbytes"] != nbytes:
                raise ProtocolError(f"node {dest} answered a get of {nbytes} bytes with {reply['nbytes']}")
            self._mover.move(dest, sock, reply, "READ", into, nbytes)
            _request(sock, {"op": "nixl_get_end", "token": reply["token"]})
            bad = len(_check_chunks([(v, c) for v, c in zip(into, checks or ()) if c])[1])
            if bad:
                self._count(checksum_errors=bad)
                raise ChecksumMismatch(f"{bad} chunk(s) of rank {body['rank']}'s step {body['step']} from node {dest} "
                                       "failed their CRC32C as they landed: another copy is asked")
            if self.payload_mac and not hmac.compare_digest(self._digest(into), reply.get("mac") or b""):
                self._count(auth_failures=1)
                raise AuthError(f"the bytes read from node {dest} fail their payload MAC: the link is tampered with")

        self._session(dest, dict(body, op="nixl_get"), transfer)
        self._count(gets_sent=1, nixl_gets_sent=1, bytes_received=nbytes)
        self._observe(dest, nbytes, time.monotonic() - t0, sent=False)

    def probe(self, dest: int, nbytes: int = PROBE_BYTES) -> float:
        if not self._speaks.get(dest):
            return super().probe(dest, nbytes)
        scratch = mmap.mmap(-1, max(nbytes, 1))  # MAP_SHARED anonymous: registered whole for the probe
        view = memoryview(scratch)[:nbytes]
        addr = _address(view)
        try:
            t0 = time.monotonic()

            def transfer(sock, reply):
                self._mover.move(dest, sock, reply, "READ", [view], nbytes)
                _request(sock, {"op": "nixl_get_end", "token": reply["token"]})

            self._session(dest, {"op": "nixl_probe", "nbytes": nbytes}, transfer)
            seconds = time.monotonic() - t0
        finally:
            view.release()
            self._registry.drop_range(addr, len(scratch))
            scratch.close()
        return self._record_probe(dest, nbytes / max(seconds, 1e-9) / 1e9)

    def _record_probe(self, dest: int, gbps: float) -> float:
        with self._lock:
            link = self.peers[dest]
            link.probe_gbps = round(gbps, 3)
            if self.link_floor and gbps < self.link_floor:
                link.warning = (f"the link to node {dest} (nixl/ucx) measured {gbps:.2f} GB/s, below --link-floor "
                                f"{self.link_floor:g} GB/s: bulk bytes may take the wrong network (check UCX_NET_DEVICES "
                                "and UCX_TLS)")
            else:
                link.warning = None
        if link.warning:
            log.warning("team: %s", link.warning)
        else:
            log.info("team: lane to node %d: %.2f GB/s over nixl/ucx", dest, gbps)
        return gbps

    def _session(self, dest: int, begin: dict, transfer):
        """``begin``, then ``transfer(sock, reply)`` on the same connection; its result. A
        typed error the peer answered is raised as it is (the stream stays in step); a broken
        stream or transfer is DaemonUnreachable."""
        sock = self._checkout(dest)
        ok = False
        try:
            try:
                reply = _request(sock, begin)
                result = transfer(sock, reply)
                ok = True
                return result
            except _PeerError as exc:
                ok = True
                raise exc.error from None
        except (OSError, EOFError, ValueError, msgpack.ExtraData) as exc:
            self._count(streams_cut=1)
            raise DaemonUnreachable(f"the data lane to node {dest} broke during a {begin['op']} ({exc}): "
                                    "its daemon died, restarted or the network dropped; another copy is tried") from None
        except _TransferFailed as exc:
            self._count(nixl_transfer_failures=1)
            raise DaemonUnreachable(f"the NIXL transfer of a {begin['op']} with node {dest} failed ({exc}): its daemon "
                                    "died, restarted or the network dropped; another copy is tried") from None
        finally:
            self._checkin(dest, sock, ok)

    @property
    def _post(self):
        """The mover's ``post`` (one window, to completion), replaceable here: tests cut in
        mid-transfer through it."""
        return self._mover.post

    @_post.setter
    def _post(self, post) -> None:
        self._mover.post = post

    # --- serving (a thread per connection) -------------------------------------------------------

    def _serve(self, sock, peer) -> None:
        try:
            super()._serve(sock, peer)
        finally:
            self._serving.drop(sock)

    def _answer(self, sock, src: int, body: dict) -> bool:
        op = body.get("op") if isinstance(body, dict) else None
        if op not in _NIXL_OPS:
            return super()._answer(sock, src, body)
        return self._serving.answer(sock, src, body)

    def _tally(self, src: int, received: int = 0, sent: int = 0) -> None:
        with self._lock:
            link = self.peers.setdefault(src, PeerLink(src))
            link.received += received
            link.sent += sent
