"""DeepSpeed checkpoints in and out of the universal format, without running their pickles.

Import (:func:`deepspeed_to_universal`) reads, with :mod:`ucpd.format.safe_unpickle` (no import of
DeepSpeed, no code from the files run):

- a **ZeRO checkpoint** as ``engine.save_checkpoint`` writes it: ``global_step<N>/`` with
  ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or ``zero_pp_rank_<d>_mp_rank_00_model_states.pt``
  (ZeRO-3), and ``[bf16_]zero_pp_rank_<d>_mp_rank_00_optim_states.pt`` per data-parallel rank.
  ZeRO-1/2: each rank's flat fp32 partition and Adam moments hold, per parameter, the fragment
  that ``param_slice_mappings`` names; a parameter is its fragments concatenated in rank order
  (as ``ds_to_universal`` does). ZeRO-3: each parameter holds ``ceil(numel / dp)`` elements in
  every rank's flat group, in ``param_shapes`` order; concatenated in rank order and cut to
  ``numel`` (as ``zero_to_fp32`` does). Tensor parallelism > 1 is refused (it needs the model's
  merge rules: use DeepSpeed's ``ds_to_universal``, then import its output);
- a **universal checkpoint** as ``ds_to_universal`` writes it: ``zero/<param>/{fp32,exp_avg,
  exp_avg_sq,step}.pt`` and ``zero/optimizer_state.pt``.

Either way a version holds ``optim/<param>/{fp32,exp_avg,exp_avg_sq}`` (consolidated, bit for bit
what DeepSpeed stored) and, where the model file has them whole (ZeRO-1/2 and universal
folders), the low-precision weights under ``<param>``. Non-tensor state (DeepSpeed's global
optimizer state, per-parameter steps, lr scheduler, step counters, config) is stored as the
global object, a ``torch.save`` of plain values (DeepSpeed's objects become
``{"__type__": name, "args": [...], "state": {...}}``), so ``torch.load(weights_only=True)``
reads it.

Export (:func:`universal_to_deepspeed_ucp`) writes DeepSpeed's universal layout from any version
that has, per parameter, ``optim/<param>/fp32`` or a floating ``<param>`` weight (moments under
``optim/<param>/exp_avg[_sq]`` when present): ``<dst>/global_step<N>/zero/<param>/*.pt``,
``zero/optimizer_state.pt``, ``mp_rank_00_model_states.pt`` (linked as
``zero_pp_rank_0_mp_rank_00_model_states.pt``, the name ZeRO-3 reads) and ``<dst>/latest_universal``, which
a DeepSpeed engine configured with ``"checkpoint": {"load_universal": true}`` loads with
``engine.load_checkpoint(dst)`` at any data-parallel size. Writing ``.pt`` files needs torch.
"""

from __future__ import annotations

import io
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import BY_NAME
from ..errors import FormatError
from . import safe_unpickle
from .roots import open_version, write_version
from .torch_bytes import dtype_name, tensor_bytes, tensor_from_array
from .writer import REPLICATED, TensorSource

Progress = Callable[[int, int], None] | None
STATES = ("fp32", "exp_avg", "exp_avg_sq")
# The DeepSpeed release whose universal layout universal_to_deepspeed_ucp writes (DeepSpeed
# checks that a checkpoint's ds_version is a version string, >= 0.3.17 for ZeRO-1).
DS_LAYOUT_VERSION = "0.19.8"
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


@dataclass
class Array:
    """One tensor read from a DeepSpeed file: torch dtype name, shape and its elements as
    numpy storage integers (C order)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def flat(self) -> np.ndarray:
        return self.data.reshape(-1)


@dataclass
class DeepSpeedCheckpoint:
    """What an import found: ``kind`` ("zero1", "zero2", "zero3" or "universal"), the folder,
    the step, per parameter its states (``{param: {"fp32"|"exp_avg"|"exp_avg_sq": Array}}``) and
    low-precision weights, and the non-tensor state as plain values."""

    kind: str
    folder: Path
    step: int
    states: dict[str, dict[str, Array]] = field(default_factory=dict)
    weights: dict[str, Array] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    hints: dict[str, dict] = field(default_factory=dict)
    dp: int = 1


# --------------------------------------------------------------------------------------------
# reading files
# --------------------------------------------------------------------------------------------


def load_file(path: Path, unsafe_pickle: bool = False) -> Any:
    """A DeepSpeed ``.pt`` file: by default through the restricted unpickler; with
    ``unsafe_pickle`` through ``torch.load(weights_only=False)`` (runs the file's code)."""
    if not unsafe_pickle:
        return safe_unpickle.load(path)
    try:
        import torch
    except ImportError:
        raise FormatError("--unsafe-pickle needs PyTorch (pip install torch)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise FormatError(f"{path}: cannot load ({type(exc).__name__}: {exc})") from None


def to_array(t: Any, where: str) -> Array:
    """An :class:`Array` of a safe_unpickle.Tensor or a torch tensor."""
    if isinstance(t, safe_unpickle.Tensor):
        if t.dtype not in BY_NAME:
            raise FormatError(f"{where}: dtype {t.dtype} is not supported by the universal format")
        return Array(t.dtype, t.shape, t.array())
    if type(t).__module__.startswith("torch") and hasattr(t, "dtype"):
        name = dtype_name(t)
        return Array(name, tuple(t.shape), tensor_bytes(t).view(BY_NAME[name].storage).reshape(tuple(t.shape)))
    raise FormatError(f"{where}: expected a tensor, found {type(t).__name__}")


def _is_tensor(t: Any) -> bool:
    return isinstance(t, safe_unpickle.Tensor) or (type(t).__module__.startswith("torch") and hasattr(t, "dtype"))


def plain(x: Any) -> Any:
    """Non-tensor state as plain values: records -> ``{"__type__", "args", "state"}`` dicts,
    tensors -> their value (scalars) or ``{"__tensor__": dtype, "shape": [...]}``."""
    if isinstance(x, safe_unpickle.Record):
        return {"__type__": x.type, "args": [plain(a) for a in x.args], "state": plain(x.state)}
    if isinstance(x, safe_unpickle.TorchDtype):
        return f"torch.{str.__str__(x)}"
    if _is_tensor(x):
        a = to_array(x, "object")
        if a.shape == () and a.dtype in ("float32", "float64", "int64", "int32", "bool"):
            return _scalar(a)
        return {"__tensor__": a.dtype, "shape": list(a.shape)}
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(plain(v) for v in x)
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if type(x).__module__.startswith("deepspeed") or hasattr(x, "__dict__"):  # unsafe_pickle: real objects
        return {"__type__": f"{type(x).__module__}.{type(x).__qualname__}", "args": [],
                "state": plain(getattr(x, "__dict__", {}))}
    return str(x)


def _scalar(a: Array) -> Any:
    np_type = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32, "bool": np.bool_}
    v = a.data.reshape(-1).view(np_type[a.dtype])[0].item()
    return v


def _step_value(x: Any) -> Any:
    if _is_tensor(x):
        a = to_array(x, "step")
        return _scalar(a) if a.shape == () else None
    return x


# --------------------------------------------------------------------------------------------
# finding the folder
# --------------------------------------------------------------------------------------------


def locate(src: str | os.PathLike) -> tuple[str, Path]:
    """``("universal" | "zero", folder)`` for a DeepSpeed checkpoint: ``src`` itself (a
    ``global_step<N>`` folder), or the tag that ``src/latest_universal`` / ``src/latest`` names."""
    src = Path(src)

    def kind(d: Path) -> str | None:
        if (d / "zero").is_dir() and (d / "zero" / "optimizer_state.pt").is_file() or (
                (d / "zero").is_dir() and any((p / "fp32.pt").is_file() for p in (d / "zero").iterdir())):
            return "universal"
        if d.is_dir() and any(_RANK_FILE.match(p.name) for p in d.iterdir()):
            return "zero"
        return None

    if src.is_dir():
        k = kind(src)
        if k:
            return k, src
        for pointer in ("latest_universal", "latest"):
            f = src / pointer
            if f.is_file():
                sub = src / f.read_text().strip()
                k = kind(sub) if sub.is_dir() else None
                if k:
                    return k, sub
    raise FormatError(
        f"{src}: not a DeepSpeed checkpoint (expected a global_step<N> folder holding "
        f"*_optim_states.pt files (ZeRO) or zero/<param>/fp32.pt (universal, from ds_to_universal), "
        f"or a folder whose latest / latest_universal file names one)"
    )


def _step_of(folder: Path, default: int | None) -> int | None:
    m = re.search(r"(\d+)$", folder.name)
    return int(m.group(1)) if m else default


# --------------------------------------------------------------------------------------------
# universal folders (ds_to_universal's output)
# --------------------------------------------------------------------------------------------


def read_universal(folder: Path, unsafe_pickle: bool = False) -> DeepSpeedCheckpoint:
    zero = folder / "zero"
    params = sorted(p.name for p in zero.iterdir() if p.is_dir() and (p / "fp32.pt").is_file())
    if not params:
        raise FormatError(f"{zero}: no parameter folders with fp32.pt")
    ck = DeepSpeedCheckpoint("universal", folder, 0)
    steps: dict[str, Any] = {}
    for p in params:
        ck.states[p] = {}
        for state in STATES:
            f = zero / p / f"{state}.pt"
            if not f.is_file():
                continue
            d = load_file(f, unsafe_pickle)
            t = d.get("param") if isinstance(d, dict) else d
            if not _is_tensor(t):
                raise FormatError(f"{f}: expected a dict with a tensor under 'param'")
            ck.states[p][state] = to_array(t, str(f))
            if isinstance(d, dict) and state == "fp32":
                extra = {k: v for k, v in d.items() if k != "param" and isinstance(v, (int, float, bool, str))}
                if extra:
                    ck.hints[p] = extra
        sf = zero / p / "step.pt"
        if sf.is_file():
            steps[p] = _step_value(load_file(sf, unsafe_pickle))
    opt = zero / "optimizer_state.pt"
    osd = plain(load_file(opt, unsafe_pickle)) if opt.is_file() else None
    if not steps and isinstance(osd, dict):  # ZeRO-3's ds_to_universal keeps the step here only
        inner = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else {}
        st = (inner.get("state") or {}).get(0) or {}
        if isinstance(st.get("step"), (int, float)):
            steps = {p: st["step"] for p in params}
    if isinstance(osd, dict) and "param_groups" not in osd and isinstance(osd.get("optimizer_state_dict"), dict):
        osd["param_groups"] = osd["optimizer_state_dict"].get("param_groups")
    ck.objects = {"steps": steps, "optimizer_state": osd}
    model = _model_files(folder)
    if model:
        msd = _read_model_states(ck, model[0], unsafe_pickle)
        # ds_to_universal of a ZeRO-3 checkpoint writes flat tensors: give them their shapes back
        shapes = _param_shapes(msd, model[0]) if isinstance(msd.get("param_shapes"), list) else {}
        for p, states in ck.states.items():
            shape = shapes.get(p)
            for key, a in states.items():
                if shape is not None and a.shape != shape:
                    if a.flat.size != int(np.prod(shape, dtype=np.int64)):
                        raise FormatError(f"{zero / p / key}.pt: {a.flat.size} elements, the model's {p} has shape "
                                          f"{list(shape)}")
                    states[key] = Array(a.dtype, shape, a.flat.reshape(shape))
    vals = [v for v in steps.values() if isinstance(v, (int, float))]
    ck.step = _step_of(folder, None) if _step_of(folder, None) is not None else int(max(vals)) if vals else 0
    return ck


def _model_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if _MODEL_FILE.match(p.name)), key=lambda p: p.name)


def _read_model_states(ck: DeepSpeedCheckpoint, path: Path, unsafe_pickle: bool) -> dict:
    sd = load_file(path, unsafe_pickle)
    if not isinstance(sd, dict):
        raise FormatError(f"{path}: expected a dict of model states")
    if int(sd.get("mp_world_size") or 1) > 1:
        raise FormatError(
            f"{path}: tensor-parallel checkpoint (mp_world_size {sd['mp_world_size']}); merging TP slices "
            f"needs the model's rules: run DeepSpeed's ds_to_universal and import its output (--from deepspeed)")
    shapes = _param_shapes(sd, path) if isinstance(sd.get("param_shapes"), list) else {}
    module = sd.get("module")
    if isinstance(module, dict):
        for name, t in module.items():
            if _is_tensor(t):
                a = to_array(t, f"{path}: module[{name!r}]")
                if a.shape == shapes.get(name, a.shape):  # ZeRO-3 leaves empty placeholders here
                    ck.weights[name] = a
    keep = ("lr_scheduler", "global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
            "ds_config", "ds_version", "buffer_names", "shared_params", "data_sampler", "random_ltd")
    ck.objects["model_states"] = plain({k: sd[k] for k in keep if k in sd})
    client = {k: v for k, v in sd.items() if k not in keep and k not in (
        "module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
        "sparse_tensor_module_names", "checkpoint_parallel_dimensions")}
    if client:
        ck.objects["client_state"] = plain(client)
    return sd


# --------------------------------------------------------------------------------------------
# ZeRO checkpoints (engine.save_checkpoint's output)
# --------------------------------------------------------------------------------------------


def _param_shapes(sd: dict, path: Path) -> "OrderedDict[str, tuple]":
    shapes = sd.get("param_shapes")
    if not isinstance(shapes, list):
        raise FormatError(f"{path}: no param_shapes (not a ZeRO checkpoint's model states)")
    out: OrderedDict[str, tuple] = OrderedDict()
    for group in shapes:
        for name, shape in group.items():
            out[name] = tuple(int(s) for s in shape)
    return out


def _group_state(osd: dict, g: int, key: str, path: Path) -> Any:
    base = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict")
    state = base.get("state") if isinstance(base, dict) else None
    if not isinstance(state, dict) or g not in state or key not in state[g]:
        raise FormatError(f"{path}: no optimizer state {key!r} for group {g} (an optimizer other than Adam?)")
    return state[g][key]


def read_zero(folder: Path, unsafe_pickle: bool = False) -> DeepSpeedCheckpoint:
    ranks: dict[int, Path] = {}
    for p in folder.iterdir():
        m = _RANK_FILE.match(p.name)
        if m:
            if int(m.group(3)) != 0:
                raise FormatError(
                    f"{folder}: tensor-parallel ZeRO checkpoint ({p.name}); merging TP slices needs the model's "
                    f"rules: run DeepSpeed's ds_to_universal and import its output (--from deepspeed)")
            ranks[int(m.group(2))] = p
    dp = len(ranks)
    if sorted(ranks) != list(range(dp)):
        raise FormatError(f"{folder}: optimizer files for data-parallel ranks {sorted(ranks)}; some are missing")
    optim = [load_file(ranks[r], unsafe_pickle) for r in range(dp)]
    osds = []
    for r, o in enumerate(optim):
        osd = o.get("optimizer_state_dict") if isinstance(o, dict) else None
        if not isinstance(osd, dict):
            raise FormatError(f"{ranks[r]}: no optimizer_state_dict")
        osds.append(osd)
    stage = osds[0].get("zero_stage")
    stage = int(stage.value if isinstance(stage, safe_unpickle.Record) else getattr(stage, "value", stage))
    if stage not in (1, 2, 3):
        raise FormatError(f"{ranks[0]}: unknown zero_stage {stage!r}")
    ck = DeepSpeedCheckpoint(f"zero{stage}", folder, 0, dp=dp)
    models = _model_files(folder)
    if not models:
        raise FormatError(f"{folder}: no *model_states.pt file")
    msd = _read_model_states(ck, models[0], unsafe_pickle)
    shapes = _param_shapes(msd, models[0])
    if stage <= 2:
        _consolidate_zero12(ck, osds, shapes, ranks)
    else:
        _consolidate_zero3(ck, osds, shapes, ranks)
    g0 = osds[0].get("base_optimizer_state") or osds[0].get("optimizer_state_dict") or {}
    steps = {}
    for g, st in (g0.get("state") or {}).items():
        steps[g] = _step_value(st.get("step"))
    glob = {k: v for k, v in osds[0].items()
            if k not in ("base_optimizer_state", "optimizer_state_dict", "single_partition_of_fp32_groups",
                         "fp32_flat_groups", "param_slice_mappings")}
    glob["param_groups"] = plain(g0.get("param_groups"))
    ck.objects.update({"steps": {p: steps.get(0) for p in ck.states} if len(steps) <= 1 else
                       _steps_by_param(ck, shapes, msd, steps),
                       "optimizer_state": plain(glob)})
    gs = msd.get("global_steps")
    ck.step = _step_of(folder, None) if _step_of(folder, None) is not None else int(gs or 0)
    return ck


def _steps_by_param(ck: DeepSpeedCheckpoint, shapes: dict, msd: dict, steps: dict) -> dict:
    out = {}
    for g, group in enumerate(msd.get("param_shapes") or []):
        for name in group:
            out[name] = steps.get(g)
    return out


def _consolidate_zero12(ck: DeepSpeedCheckpoint, osds: list[dict], shapes: dict, ranks: dict) -> None:
    pieces: dict[str, dict[str, list[np.ndarray]]] = {}
    dtypes: dict[str, str] = {}
    for r, osd in enumerate(osds):
        where = ranks[r]
        maps = osd.get("param_slice_mappings")
        fp32 = osd.get("single_partition_of_fp32_groups")
        if not isinstance(maps, list) or not isinstance(fp32, list) or len(maps) != len(fp32):
            raise FormatError(f"{where}: no param_slice_mappings / single_partition_of_fp32_groups")
        for g, mapping in enumerate(maps):
            flats = {"fp32": to_array(fp32[g], f"{where}: fp32 group {g}")}
            for key in ("exp_avg", "exp_avg_sq"):
                flats[key] = to_array(_group_state(osd, g, key, where), f"{where}: {key} group {g}")
            for name, addr in mapping.items():
                st = addr.state if isinstance(addr, safe_unpickle.Record) else vars(addr)
                start, numel = int(st["start"]), int(st["numel"])
                for key, a in flats.items():
                    if start + numel > a.flat.size:
                        raise FormatError(f"{where}: fragment of {name} [{start}, {start + numel}) runs past "
                                          f"its {key} partition ({a.flat.size})")
                    pieces.setdefault(name, {}).setdefault(key, []).append(a.flat[start:start + numel])
                    dtypes[f"{name}/{key}"] = a.dtype
    for name, shape in shapes.items():
        if name not in pieces:
            raise FormatError(f"{ck.folder}: no optimizer fragment of {name} in any rank")
        numel = int(np.prod(shape, dtype=np.int64))
        ck.states[name] = {}
        for key, parts in pieces[name].items():
            flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if flat.size != numel:
                raise FormatError(f"{ck.folder}: {name} {key}: fragments hold {flat.size} elements, shape "
                                  f"{list(shape)} needs {numel}")
            ck.states[name][key] = Array(dtypes[f"{name}/{key}"], shape, flat.reshape(shape))


def _consolidate_zero3(ck: DeepSpeedCheckpoint, osds: list[dict], shapes: dict, ranks: dict) -> None:
    dp = len(osds)
    flats: list[dict[str, np.ndarray]] = []
    dtype = {}
    for r, osd in enumerate(osds):
        where = ranks[r]
        groups = osd.get("fp32_flat_groups")
        if not isinstance(groups, list):
            raise FormatError(f"{where}: no fp32_flat_groups")
        per: dict[str, np.ndarray] = {}
        for key in STATES:
            arrs = [to_array(groups[g] if key == "fp32" else _group_state(osd, g, key, where), f"{where}: {key}")
                    for g in range(len(groups))]
            dtype[key] = arrs[0].dtype
            per[key] = np.concatenate([a.flat for a in arrs]) if len(arrs) > 1 else arrs[0].flat
        flats.append(per)
    offset = 0
    for name, shape in shapes.items():
        numel = int(np.prod(shape, dtype=np.int64))
        part = -(-numel // dp)
        ck.states[name] = {}
        for key in STATES:
            chunks = [f[key][offset:offset + part] for f in flats]
            if any(c.size != part for c in chunks):
                raise FormatError(f"{ck.folder}: {name} {key}: ZeRO-3 partitions end early")
            ck.states[name][key] = Array(dtype[key], shape, np.concatenate(chunks)[:numel].reshape(shape))
        offset += part


# --------------------------------------------------------------------------------------------
# into and out of the universal format
# --------------------------------------------------------------------------------------------


def read_deepspeed(src: str | os.PathLike, unsafe_pickle: bool = False) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed ZeRO or universal checkpoint (see the module docstring)."""
    kind, folder = locate(src)
    return read_universal(folder, unsafe_pickle) if kind == "universal" else read_zero(folder, unsafe_pickle)


def _torch_save_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def deepspeed_to_universal(
    src: str | os.PathLike, root: str | os.PathLike, *, step: int | None = None,
    shard_bytes: int | None = None, progress: Progress = None, unsafe_pickle: bool = False,
    require: str | None = None,
) -> Path:
    """A DeepSpeed ZeRO-1/2/3 or universal checkpoint -> version ``step`` under ``root``.
    ``require="universal"`` refuses ZeRO folders (``--from deepspeed-ucp``)."""
    if require == "universal":
        try:
            kind = locate(src)[0]
        except FormatError:
            kind = None
    if require == "universal" and kind != "universal":
        raise FormatError(f"{src}: not a DeepSpeed universal checkpoint (expected zero/<param>/fp32.pt, or a "
                          f"latest_universal file naming such a folder); for a ZeRO checkpoint use --from deepspeed")
    ck = read_deepspeed(src, unsafe_pickle)
    sources = []
    for name, a in ck.weights.items():
        sources.append(TensorSource(name, a.dtype, a.shape, REPLICATED, np.ascontiguousarray(a.data).view(np.uint8)))
    for p, states in ck.states.items():
        for key in STATES:
            if key in states:
                a = states[key]
                sources.append(TensorSource(f"optim/{p}/{key}", a.dtype, a.shape, REPLICATED,
                                            np.ascontiguousarray(a.data).reshape(-1).view(np.uint8)))
    layout = {"source": "deepspeed", "kind": ck.kind, "dp": ck.dp, "path": str(ck.folder), "params": ck.hints,
              "objects_encoding": "torch.save"}
    kw = {"shard_bytes": shard_bytes} if shard_bytes else {}
    return write_version(root, ck.step if step is None else step, sources, layout=layout,
                         objects={"global": _torch_save_bytes(ck.objects)}, progress=progress, **kw)


def deepspeed_ucp_to_universal(src: str | os.PathLike, root: str | os.PathLike, **kw: Any) -> Path:
    """A DeepSpeed universal checkpoint folder (``ds_to_universal``'s output) -> a version."""
    return deepspeed_to_universal(src, root, require="universal", **kw)


def _global_objects(r: Any) -> dict:
    if r.objects["global"] is None or r.meta.layout.get("objects_encoding") != "torch.save":
        return {}
    import torch

    try:  # plain values only
        g = torch.load(io.BytesIO(r.objects["global"]), weights_only=True)
    except Exception:
        return {}
    return g if isinstance(g, dict) else {}


def _export_params(r: Any, strip_prefix: str) -> dict[str, dict[str, str]]:
    """``{deepspeed name: {"fp32"|"exp_avg"|"exp_avg_sq"|"weight": tensor name}}``."""
    params: dict[str, dict[str, str]] = {}
    for n in r.tensors:
        m = re.match(r"^optim/(.+)/(fp32|exp_avg|exp_avg_sq)$", n)
        if m:
            params.setdefault(m.group(1), {})[m.group(2)] = n
    floating = ("float32", "float64", "float16", "bfloat16")
    for n, t in r.tensors.items():
        if not n.startswith("optim/") and t.dtype in floating and (n in params or not any(
                k.startswith("optim/") for k in r.tensors)):
            params.setdefault(n, {})["weight"] = n
    out = {}
    for n, d in params.items():
        if "fp32" not in d and "weight" not in d:
            raise FormatError(f"{r.path}: optim/{n}/... has moments but neither optim/{n}/fp32 nor a weight {n!r}")
        name = n[len(strip_prefix):] if strip_prefix and n.startswith(strip_prefix) else n
        out[name] = d
    if not out:
        raise FormatError(f"{r.path}: no parameters to export (no optim/<name>/fp32 and no floating weights)")
    return out


def universal_to_deepspeed_ucp(
    src: str | os.PathLike, dst: str | os.PathLike, *, step: int | None = None, progress: Progress = None,
    strip_prefix: str = "",
) -> Path:
    """One version -> DeepSpeed's universal layout under ``dst`` (see the module docstring).

    fp32 master weights come from ``optim/<p>/fp32`` (else the weight, cast to fp32); Adam
    moments from ``optim/<p>/exp_avg[_sq]`` (a parameter without them is written without, and
    DeepSpeed loads only the states present). ``strip_prefix`` drops a prefix from the names
    (``"model."`` for a state saved as ``{"model": model.state_dict(), ...}``). Returns the
    ``global_step<N>`` folder."""
    import torch

    dst = Path(dst)
    with open_version(src, step) as r:
        params = _export_params(r, strip_prefix)
        g = _global_objects(r)
        layout = r.meta.layout
        tag = f"global_step{r.step}"
        folder = dst / tag
        if folder.exists():
            raise FormatError(f"{folder}: already exists; remove it or choose another DST")
        zero = folder / "zero"
        zero.mkdir(parents=True)
        steps = g.get("steps") or {}
        hints = layout.get("params") or {} if layout.get("source", "").startswith("deepspeed") else {}
        total = sum(t.nbytes for t in r.tensors.values())
        done = 0

        def tensor(name: str) -> Any:
            nonlocal done
            r.verify(name)
            info = r.tensors[name]
            done += info.nbytes
            if progress:
                progress(done, total)
            return tensor_from_array(r.array(name), info.dtype).clone()

        module: OrderedDict[str, Any] = OrderedDict()
        shapes: OrderedDict[str, Any] = OrderedDict()
        for p, d in params.items():
            pdir = zero / p
            pdir.mkdir(parents=True)
            fp32 = tensor(d["fp32"]) if "fp32" in d else tensor(d["weight"]).float()
            extra = hints.get(p, {})
            torch.save({"param": fp32.float(), **extra}, pdir / "fp32.pt")
            for key in ("exp_avg", "exp_avg_sq"):
                if key in d:
                    torch.save({"param": tensor(d[key]).float(), **extra}, pdir / f"{key}.pt")
            s = steps.get(p, steps.get(d.get("fp32", "").removeprefix("optim/").rsplit("/", 1)[0]))
            torch.save(torch.tensor(float(s if isinstance(s, (int, float)) else r.step)), pdir / "step.pt")
            module[p] = tensor(d["weight"]) if "weight" in d else fp32
            shapes[p] = torch.Size(fp32.shape)
        opt = g.get("optimizer_state") if isinstance(g.get("optimizer_state"), dict) else {}
        groups = opt.get("param_groups")
        if not isinstance(groups, list) or not groups:
            # hyperparameters unknown: placeholders copy nothing, and DeepSpeed loads every group's
            # states (it walks zip(engine groups, these)); the engine keeps its own lr, betas ...
            groups = [{"params": []} for _ in range(64)]
        first = [s for s in steps.values() if isinstance(s, (int, float))]
        state_step = float(first[0]) if first else float(r.step)
        optim_sd = {k: v for k, v in opt.items() if k in ("dynamic_loss_scale", "overflow", "clip_grad", "ds_version")}
        optim_sd.setdefault("ds_version", DS_LAYOUT_VERSION)
        optim_sd["param_groups"] = groups
        # ZeRO-3 reads the step and the groups from here
        optim_sd["optimizer_state_dict"] = {"state": {0: {"step": torch.tensor(state_step)}}, "param_groups": groups}
        torch.save(optim_sd, zero / "optimizer_state.pt")
        ms = g.get("model_states") if isinstance(g.get("model_states"), dict) else {}
        model_states = {
            "module": module, "buffer_names": [], "optimizer": None, "param_shapes": [shapes],
            "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
            "lr_scheduler": ms.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
            "sparse_tensor_module_names": set(), "skipped_steps": int(ms.get("skipped_steps") or 0),
            "global_steps": r.step, "global_samples": int(ms.get("global_samples") or 0),
            "dp_world_size": int(ms.get("dp_world_size") or 1), "mp_world_size": 1,
            "ds_version": ms.get("ds_version") or DS_LAYOUT_VERSION,
        }
        torch.save(model_states, folder / "mp_rank_00_model_states.pt")
        # a ZeRO-3 engine looks for its model states under this name (the same file: a link)
        try:
            os.link(folder / "mp_rank_00_model_states.pt", folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        except OSError:
            torch.save(model_states, folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (dst / "latest_universal").write_text(tag)
    return folder
