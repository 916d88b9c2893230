"""Read ``torch.save`` files without running the code their pickles name.

A ``torch.save`` file (the zip format of torch >= 1.6) is a zip archive holding
``<archive>/data.pkl`` (a pickle of the saved object) and ``<archive>/data/<key>`` (the raw bytes
of each storage, stored uncompressed). Unpickling ``data.pkl`` with :mod:`pickle` would import and
call whatever the file names; this module's :class:`SafeUnpickler` overrides
``pickle.Unpickler.find_class`` so that only an allowlist resolves, and each allowed name becomes
something inert:

- tensors (``torch._utils._rebuild_tensor_v2/v3``, ``_rebuild_parameter``, and
  ``torch._tensor._rebuild_from_type_v2`` over those to ``torch.Tensor``/``Parameter``) -> :class:`Tensor`, a
  record of dtype, shape, strides and offset over a :class:`Storage` whose bytes are a zero-copy
  view of the file (mapped read-only); ``Tensor.array()`` gives the elements as numpy storage
  integers (``ucpd.dtypes.DType.storage``), so neither torch nor numpy interprets them;
- ``torch.Size`` -> ``tuple``; ``torch.device`` -> ``str``; ``torch.float32`` and the other
  dtypes -> :class:`TorchDtype`; ``collections.OrderedDict``, ``set``, ``frozenset``,
  ``complex``, ``slice`` -> themselves (constructors with no side effects); ``_codecs.encode``
  (how protocol 2 writes ``bytes``) only for latin-1 text;
- the classes in :data:`RECORD_TYPES` (DeepSpeed's loss scalers, its ZeRO stage enum, its
  fragment addresses, ``argparse.Namespace``) -> :class:`Record`: the type's name, the arguments
  it was built with and the state ``pickle`` would have given it. Nothing of DeepSpeed (or of
  torch) is imported: the record is built by this module alone.

Any other name raises :class:`ucpd.errors.UnsafePickle` naming it (the caller adds the file),
and so does a persistent id other than a storage. ``extra_types`` admits more record types for
one call. torch is not needed.
"""

from __future__ import annotations

import math

import io
import mmap
import pickle
import pickletools
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import BY_NAME
from ..errors import FormatError, UnsafePickle

# Types that genuine DeepSpeed checkpoints hold (DeepSpeed 0.19: ZeRO-1/2/3 model and optimizer
# files, the universal folders of ds_to_universal), read as inert records.
RECORD_TYPES: frozenset[str] = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScalerBase",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.constants.SubparamShape",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
    "argparse.Namespace",
})

# storage classes named in persistent ids -> dtype names (UntypedStorage: bytes)
_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "UntypedStorage": "uint8",
}
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


def _bytearray(source: Any = b"", encoding: Any = None) -> bytearray:
    """``bytearray`` as pickles rebuild one (protocols 2-4: from bytes, or latin-1 text), never
    ``bytearray(n)``: a pickle of a few bytes must not make the reader allocate n of them."""
    if isinstance(source, (bytes, bytearray)) and encoding is None:
        return bytearray(source)
    if isinstance(source, str) and encoding in ("latin-1", "latin1"):
        return bytearray(source.encode("latin-1"))
    raise UnsafePickle(f"bytearray built from {type(source).__name__} (only from bytes or latin-1 text)")


_SAFE_BUILTINS = {"set": set, "frozenset": frozenset, "complex": complex, "slice": slice,
                  "bytearray": _bytearray}
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_lengths(data: bytes) -> None:
    """Refuse, before the C unpickler sees them, opcodes that make it allocate what the pickle
    merely claims: a BYTEARRAY8 (or a FRAME) longer than the pickle, and memo indices past its
    length (the memo table grows to the index: ``LONG_BINPUT 2**31`` in a 20-byte pickle would
    make the reader zero GiBs). ``pickletools.genops`` checks every length against the bytes
    left; one pass over the opcodes, no objects built."""
    limit = len(data)
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _MEMO_PUTS and (not isinstance(arg, int) or arg > limit):
                raise FormatError(f"cannot unpickle (memo index {arg} in a pickle of {limit} bytes)")
            if op.name == "FRAME" and arg > limit:
                raise FormatError(f"cannot unpickle (frame of {arg} bytes in a pickle of {limit} bytes)")
    except FormatError:
        raise
    except Exception as exc:  # ValueError for a length past the end, and others for bad opcodes
        raise FormatError(f"cannot unpickle (malformed: {exc})") from None


class TorchDtype(str):
    """A torch dtype named in a pickle (``torch.float32`` -> ``TorchDtype("float32")``)."""

    def __repr__(self) -> str:
        return f"torch.{str.__str__(self)}"


class Storage:
    """The bytes of one stored torch storage: ``buf`` is a read-only uint8 view of the file."""

    __slots__ = ("key", "dtype", "numel", "buf")

    def __init__(self, key: str, dtype: str, numel: int, buf: np.ndarray) -> None:
        self.key, self.dtype, self.numel, self.buf = key, dtype, numel, buf


class Tensor:
    """An inert tensor: ``dtype`` (torch name), ``shape``, ``stride`` and ``offset`` (in
    elements) over a :class:`Storage`."""

    __slots__ = ("storage", "offset", "shape", "stride", "dtype", "requires_grad", "is_parameter", "attrs")

    def __init__(self, storage: Storage, offset: int, shape: tuple, stride: tuple, dtype: str,
                 requires_grad: bool = False) -> None:
        self.storage, self.offset, self.dtype = storage, int(offset), dtype
        self.shape, self.stride = tuple(int(s) for s in shape), tuple(int(s) for s in stride)
        self.requires_grad, self.is_parameter, self.attrs = bool(requires_grad), False, None
        if len(self.shape) != len(self.stride) or any(s < 0 for s in self.shape + self.stride) or self.offset < 0:
            raise FormatError(f"storage {storage.key}: bad tensor geometry {self.shape}/{self.stride}@{self.offset}")
        if self.numel:
            last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
            if (last + 1) * BY_NAME[dtype].itemsize > storage.buf.nbytes:
                raise FormatError(f"storage {storage.key}: tensor {self.shape} at {self.offset} runs past its "
                                  f"{storage.buf.nbytes} bytes")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * BY_NAME[self.dtype].itemsize

    def array(self) -> np.ndarray:
        """The elements as numpy storage integers (``DType.storage``), C-contiguous: a read-only
        view of the file when the tensor is contiguous, else a copy."""
        dt = BY_NAME[self.dtype].storage
        if self.numel == 0:
            return np.empty(self.shape, dt)
        item = dt.itemsize
        base = self.storage.buf[self.offset * item:]
        usable = base.nbytes - base.nbytes % item
        flat = base[:usable].view(dt)
        a = np.lib.stride_tricks.as_strided(flat, self.shape, tuple(s * item for s in self.stride), writeable=False)
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)

    def __repr__(self) -> str:
        return f"Tensor({self.dtype}, {list(self.shape)})"


class Record:
    """An inert stand-in for an object of an allowed type: ``type`` ("module.Name"), ``args``
    (what it was constructed with) and ``state`` (what ``__setstate__`` would have got, usually
    the instance ``__dict__``). ``r["x"]``/``r.get("x")`` read the state dict; ``r.value`` is
    the single argument (enum members)."""

    type: str = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Record":
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else self.args

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default) if isinstance(self.state, dict) else default

    def __getitem__(self, key: str) -> Any:
        if not isinstance(self.state, dict):
            raise KeyError(key)
        return self.state[key]

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, Record) and other.type == self.type and other.args == self.args
                and other.state == self.state)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Record({self.type}, args={self.args!r}, state={self.state!r})"


_RECORD_CLASSES: dict[str, type[Record]] = {}


def record_class(qualname: str) -> type[Record]:
    """The (cached) :class:`Record` subclass standing in for ``qualname``."""
    cls = _RECORD_CLASSES.get(qualname)
    if cls is None:
        cls = type(qualname.rsplit(".", 1)[-1], (Record,), {"type": qualname, "__module__": __name__})
        _RECORD_CLASSES[qualname] = cls
    return cls


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    if not isinstance(storage, Storage):
        raise UnsafePickle("_rebuild_tensor_v2 called on something other than a stored storage")
    return Tensor(storage, offset, size, stride, storage.dtype, requires_grad)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if not isinstance(storage, Storage) or not isinstance(dtype, TorchDtype) or dtype not in BY_NAME:
        raise UnsafePickle(f"_rebuild_tensor_v3 with unsupported arguments (dtype {dtype!r})")
    return Tensor(storage, offset, size, stride, str(dtype), requires_grad)


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    if not isinstance(data, Tensor):
        raise UnsafePickle("_rebuild_parameter of something other than a tensor")
    data.requires_grad, data.is_parameter = bool(requires_grad), True
    return data


class _TensorClass:
    """``torch.Tensor`` / ``torch.nn.Parameter`` named as the type of a rebuilt tensor."""

    def __init__(self, name: str) -> None:
        self.name = name


def _rebuild_from_type_v2(func, new_type, args, state=None):
    """torch's rebuild of a tensor with Python attributes (``tensor.__dict__``): only over the
    allowed tensor rebuilders, to ``torch.Tensor`` or ``Parameter``; the attributes are kept as
    ``Tensor.attrs``."""
    if func not in (_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter) or not isinstance(new_type, _TensorClass):
        raise UnsafePickle(f"_rebuild_from_type_v2 of {getattr(new_type, 'name', new_type)!r}")
    t = func(*args)
    if state:
        t.attrs = state
    if new_type.name == "Parameter":
        t.is_parameter = True
    return t


def _encode(text: Any, encoding: str = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise UnsafePickle(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    if not (isinstance(cls, type) and issubclass(cls, Record)) or base is not object:
        raise UnsafePickle(f"copyreg._reconstructor of {getattr(cls, '__name__', cls)!r}")
    obj = cls.__new__(cls)
    if state is not None:
        obj.args = (state,)
    return obj


_TORCH = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorClass("Tensor"),
    ("torch.nn.parameter", "Parameter"): _TensorClass("Parameter"),
    ("torch", "Size"): lambda dims=(): tuple(int(d) for d in dims),
    ("torch", "device"): lambda *a: ":".join(str(x) for x in a),
    ("collections", "OrderedDict"): OrderedDict,
    ("_codecs", "encode"): _encode,
    ("copyreg", "_reconstructor"): _reconstructor,
}


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the allowlist (see the module docstring) and
    loads storages from ``storages(key, dtype, numel) -> np.ndarray[uint8]``."""

    def __init__(self, file: Any, storages: Any = None, extra_types: frozenset[str] = frozenset()) -> None:
        super().__init__(file)
        self._storages = storages
        self._records = RECORD_TYPES | frozenset(extra_types)
        self._loaded: dict[str, Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)  # protocol 2 (torch.save) writes Python 2 names
        fn = _TORCH.get((module, name))
        if fn is not None:
            return fn
        qual = f"{module}.{name}"
        if qual in self._records:
            return record_class(qual)
        if module == "torch" and name in BY_NAME:
            return TorchDtype(name)
        if module == "builtins" and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        raise UnsafePickle(
            f"holds an object of type {qual}, which ucpd does not read without running the code it "
            f"names; if you trust the file, pass --unsafe-pickle (unsafe_pickle=True)"
        )

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] not in ("storage", b"storage"):
            raise UnsafePickle(f"unexpected persistent id {str(pid)[:80]!r} (only torch storages are read)")
        stype, key, _location, numel = pid[1:5]
        if self._storages is None:
            raise UnsafePickle("a storage outside a torch zip archive")
        if isinstance(stype, TorchDtype):  # not seen in practice; be strict about it
            raise UnsafePickle(f"storage of type {stype!r}")
        dtype = getattr(stype, "_ucpd_dtype", None)
        if dtype is None:
            raise UnsafePickle(f"unknown storage type {stype!r}")
        key = key.decode() if isinstance(key, bytes) else str(key)
        st = self._loaded.get(key)
        if st is None:
            nbytes = int(numel) * BY_NAME[dtype].itemsize
            st = self._loaded[key] = Storage(key, dtype, int(numel), self._storages(key, nbytes))
        return st


class _StorageType:
    """A storage class named by a persistent id (``torch.FloatStorage`` ...)."""

    def __init__(self, name: str) -> None:
        self.name, self._ucpd_dtype = name, _STORAGES[name]

    def __repr__(self) -> str:
        return f"torch.{self.name}"


for _n in _STORAGES:
    _TORCH[("torch", _n)] = _StorageType(_n)


def _member_offset(mm: mmap.mmap, info: zipfile.ZipInfo, path: Path) -> int:
    """Where the (stored, uncompressed) bytes of zip member ``info`` start in the file."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise FormatError(f"{path}: {info.filename} is compressed; torch.save never compresses storages")
    h = info.header_offset
    if mm[h:h + 4] != b"PK\x03\x04":
        raise FormatError(f"{path}: bad zip local header for {info.filename}")
    n, e = struct.unpack("<HH", mm[h + 26:h + 30])
    start = h + 30 + n + e
    if start + info.file_size > len(mm):
        raise FormatError(f"{path}: {info.filename} runs past the end of the file")
    return start


def load(path: str | Path, *, extra_types: frozenset[str] = frozenset()) -> Any:
    """Load a ``torch.save`` file (zip format) with :class:`SafeUnpickler`. Tensors come back as
    :class:`Tensor` over a read-only map of the file (kept open while any view lives).

    Raises FormatError for a file that is not a torch zip archive (including the legacy format
    of torch < 1.6) and UnsafePickle (a FormatError) for a name outside the allowlist, both
    naming the file."""
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise FormatError(f"{path}: not a torch.save zip archive ({exc}); files of torch < 1.6 "
                          f"(_use_new_zipfile_serialization=False) are not read safely") from None
    with zf:
        infos = {i.filename: i for i in zf.infolist()}
        pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise FormatError(f"{path}: not a torch.save archive (expected one <archive>/data.pkl)")
        prefix = pkls[0][: -len("data.pkl")]
        order = infos.get(prefix + "byteorder")
        if order is not None and zf.read(order).strip() not in (b"little", b""):
            raise FormatError(f"{path}: big-endian storages are not supported")
        data = zf.read(pkls[0])
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    whole = np.frombuffer(mm, np.uint8) if size else np.empty(0, np.uint8)

    def storages(key: str, nbytes: int) -> np.ndarray:
        info = infos.get(f"{prefix}data/{key}")
        if info is None:
            raise FormatError(f"{path}: storage {key} is missing")
        if info.file_size < nbytes:
            raise FormatError(f"{path}: storage {key} has {info.file_size} bytes, {nbytes} expected")
        start = _member_offset(mm, info, path)
        return whole[start:start + nbytes]

    try:
        _check_lengths(data)
        return SafeUnpickler(io.BytesIO(data), storages, extra_types).load()
    except UnsafePickle as exc:
        raise UnsafePickle(f"{path}: {exc}") from None
    except FormatError:
        raise
    except Exception as exc:  # a malformed pickle: UnpicklingError, EOFError, TypeError ...
        raise FormatError(f"{path}: cannot unpickle ({type(exc).__name__}: {exc})") from None


def loads_pickle(data: bytes, *, extra_types: frozenset[str] = frozenset()) -> Any:
    """Unpickle plain bytes with the same allowlist (no storages)."""
    try:
        _check_lengths(data)
        return SafeUnpickler(io.BytesIO(data), None, extra_types).load()
    except (UnsafePickle, FormatError):
        raise
    except Exception as exc:
        raise FormatError(f"cannot unpickle ({type(exc).__name__}: {exc})") from None
