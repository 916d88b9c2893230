"""Export a version's model weights as a Hugging Face checkpoint folder.

``universal_to_hf`` writes ``model-0000i-of-0000K.safetensors`` shards (at most ``shard_bytes``
each, tensors whole) and ``model.safetensors.index.json`` (``{"metadata": {"total_size": N},
"weight_map": {name: file}}``), which ``transformers``' ``from_pretrained`` loads once the
model's ``config.json`` is beside them (``config=`` copies one in). No torch needed.

Which tensors are weights: every tensor not under ``optim/``; a parameter that only has fp32
master weights (``optim/<p>/fp32``, e.g. imported from a ZeRO-3 checkpoint, whose model files
hold no whole weights) is written from them, in fp32. ``strip_prefix`` keeps only the tensors
under that prefix and drops it, mapping names back to the model's own (``"model."`` for a
state snapshotted as ``{"model": model.state_dict(), "optim": ...}``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import FormatError
from .roots import open_version
from .writer import TensorSource, write_safetensors

Progress = Callable[[int, int], None] | None
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1000**3  # transformers' default max_shard_size, "5GB"


def hf_weights(names: dict[str, str], strip_prefix: str = "") -> dict[str, str]:
    """``{hf name: tensor name}`` from ``{tensor name: dtype}`` (see the module docstring)."""
    out: dict[str, str] = {}
    for n in names:
        if n.startswith("optim/"):
            continue
        if strip_prefix and not n.startswith(strip_prefix):
            continue
        out[n[len(strip_prefix):]] = n
    for n in names:
        if n.startswith("optim/") and n.endswith("/fp32"):
            p = n[len("optim/"):-len("/fp32")]
            if strip_prefix and not p.startswith(strip_prefix):
                continue
            out.setdefault(p[len(strip_prefix):], n)
    return out


def universal_to_hf(
    src: str | os.PathLike, dst: str | os.PathLike, *, step: int | None = None, progress: Progress = None,
    strip_prefix: str = "", shard_bytes: int = DEFAULT_SHARD_BYTES, config: str | os.PathLike | None = None,
) -> Path:
    """One version's weights -> ``dst`` (a folder) as Hugging Face safetensors shards plus their
    index; every chunk verified as it is read. Returns ``dst``."""
    dst = Path(dst)
    if dst.exists() and (dst / INDEX).exists():
        raise FormatError(f"{dst}: already holds {INDEX}; remove it or choose another DST")
    with open_version(src, step) as r:
        names = hf_weights({n: t.dtype for n, t in r.tensors.items()}, strip_prefix)
        if not names:
            raise FormatError(f"{r.path}: no model weights" + (f" under {strip_prefix!r}" if strip_prefix else ""))
        shards: list[list[str]] = [[]]
        size = 0
        for hf in names:
            nbytes = r.tensors[names[hf]].nbytes
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(hf)
            size += nbytes
        dst.mkdir(parents=True, exist_ok=True)
        total = sum(r.tensors[n].nbytes for n in names.values())
        done = 0
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            sources = []
            for hf in shard:
                t = r.tensors[names[hf]]
                r.verify(t.name)
                sources.append(TensorSource(hf, t.dtype, t.shape, t.pattern, r.bytes_view(t.name)))
                weight_map[hf] = fname
            base = done

            def part(d: int, _t: int, base: int = base) -> None:
                if progress:
                    progress(base + d, total)

            write_safetensors(dst / fname, sources, metadata={"format": "pt"}, progress=part)
            done += sum(r.tensors[names[hf]].nbytes for hf in shard)
        index = {"metadata": {"total_size": total, "ucpd.step": r.step}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = dst / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, dst / INDEX)
    if config is not None:
        shutil.copyfile(config, dst / "config.json")
    return dst
