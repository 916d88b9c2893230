"""Resharded reads: the slice of a consolidated tensor that one placement wants.

The version is the single source: every global tensor is one contiguous C-order buffer
holding its full box. ``ucpd.ucl`` resolves the placement and plans the copies;
``ucpd.checked`` runs them, verifying exactly the checksum chunks they read (fused copy+CRC where
the windows allow).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import BY_NAME
from ..errors import PlacementMismatch

if TYPE_CHECKING:  # pragma: no cover
    from .reader import VersionReader

def read_local(
    reader: VersionReader, name: str, placement: Any, local_shape: Sequence[int], out: np.ndarray | None = None
) -> np.ndarray:
    """See ``VersionReader.read_local``."""
    from ..checked import CheckedCopier
    from ..ucl import (
        CopyPlan,
        Placement,
        SourcePiece,
        contiguous_view,
        execute,
        full_box,
        placement_from_dict,
        plan_restore,
        resolve,
    )

    if not isinstance(placement, Placement):
        placement = placement_from_dict(placement)
    local_shape = tuple(int(s) for s in local_shape)
    frags = resolve(name, placement, local_shape)
    needed = sorted({f.name for f in frags if f.pieces})
    sources = {}
    for n in needed:
        t = reader.info(n)
        sources[n] = [SourcePiece(n, contiguous_view(t.shape), full_box(t.shape), t.shape)]
    dtypes = {reader.tensors[n].dtype for n in needed}
    if not dtypes and name in reader.tensors:
        dtypes = {reader.tensors[name].dtype}
    if len(dtypes) != 1:
        raise PlacementMismatch(
            f"tensor {name!r}: the local tensor would mix dtypes {sorted(dtypes)}" if dtypes
            else f"tensor {name!r}: the placement reads nothing from this version, dtype unknown"
        )
    dname = dtypes.pop()
    dt = BY_NAME[dname]
    plan = plan_restore(frags, sources)

    numel = prod(local_shape)
    if out is None:
        out = np.empty(local_shape, dtype=dt.storage)
    else:
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise PlacementMismatch(f"tensor {name!r}: out must be a writable C-contiguous numpy array")
        if out.nbytes != numel * dt.itemsize or out.itemsize not in (1, dt.itemsize):
            raise PlacementMismatch(
                f"tensor {name!r}: out holds {out.nbytes} bytes ({out.dtype}), the local tensor "
                f"{dname}{list(local_shape)} needs {numel * dt.itemsize}"
            )
    flat = out.reshape(-1).view(dt.storage)

    run = CheckedCopier({key: reader.checked_source(key) for key in plan.keys()})
    for c in plan.copies:
        run.add_array(c, flat)
    run.run()
    if plan.fills:
        execute(CopyPlan((), plan.fills), {}, flat, dtype=dname)
    return out.reshape(local_shape)
