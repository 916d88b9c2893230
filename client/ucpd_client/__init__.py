"""ucpd_client: the trainer-side library of ucpd.

    from ucpd_client import Checkpointer, placement as P
    ckpt = Checkpointer()
    h = ckpt.snapshot(step, state, placements={"model.qkv.weight": P.Shard(0, tp_rank, tp)})
    h.staged(); h.wait()
    ckpt.restore(state)
"""

from . import errors, placement
from . import dataloader  # noqa: F401  (ShardedSampler: a data-loader position any dp can resume)
from .checkpointer import Checkpointer, SnapshotHandle
from .weights import Subscription, Weights

__all__ = ["Checkpointer", "SnapshotHandle", "Weights", "Subscription", "placement", "errors"]
