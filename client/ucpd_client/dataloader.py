"""Training-loop state that is not tensors: where the data loader is, and the random generators.

**Data-loader position.** A data-parallel job reads its data as a sequence of *global* batches,
each split among the data-parallel ranks. :class:`ShardedSampler` records the position in that
sequence as global numbers — the sampler's seed, the epoch, and how many samples of the epoch's
order the job has consumed — so the same position means the same thing under any data-parallel
size. A job restarted with another ``dp`` hands each of its ranks its part of the next global
batch: no sample is skipped or repeated::

    from ucpd_client.dataloader import ShardedSampler
    sampler = ShardedSampler(len(dataset), dp_rank, dp, global_batch=256, seed=1234)
    if restored:
        sampler.load_state_dict(state["loader"])     # saved by a job with any dp
    for indices in sampler:                          # this rank's part of each global batch
        ...train on dataset[indices]...
        state["loader"] = sampler.state_dict()       # plain values: seed, epoch, consumed, ...
        ckpt.snapshot(step, state, ...)

The state is the same on every rank at a step boundary (every rank has taken the same global
batches), so whichever rank's copy a restored rank gets (ucpd hands rank r the plain values of
the old rank r, else of rank 0) it continues correctly. With a prefetching ``DataLoader`` the
sampler runs ahead of training: save the state of the batches trained on, e.g. by iterating the
sampler in the training loop and passing the indices to the dataset yourself.

**Random generators.** :func:`rng_state` captures this rank's generators (torch CPU and CUDA,
Python's ``random``, NumPy's global generator) as plain values tagged with their *owner* — the
layout and the rank — and :func:`restore_rng` puts them back. What a rank gets back:

- the same rank of the same layout: its own generators, exactly (``"exact"``): a restart on the
  same layout continues every random stream as if nothing happened;
- a rank of another layout (another tp/pp/dp, or a rank number the old job did not have): a
  fresh state derived from ``(seed, step, owner)`` (``"reseeded"``) — deterministic,
  reproducible, and distinct per rank. It never inherits another rank's stream, since the old
  rank with the same number played another role (two ranks sharing a stream would draw
  correlated dropout masks, for instance).

Randomness that must continue *identically across layouts* (dropout masks, data shuffling)
should not come from per-rank generator states at all but from counters: draw it from a
generator seeded with ``(seed, step, global sample or micro-batch index)``, as this sampler does
for its shuffle and the example GPT trainer (``examples/gpt``) does for dropout.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Iterator

import torch

_STATE_VERSION = 1


class ShardedSampler:
    """Per data-parallel rank indices of a sequence of global batches, resumable on any ``dp``.

    Epoch ``e`` visits the dataset in the order ``randperm(dataset_size)`` drawn from a generator
    seeded with ``seed + e`` (``arange`` when ``shuffle`` is False). Each step takes the next
    ``global_batch`` indices of that order; rank ``dp_rank`` gets its contiguous part of them
    (``torch.tensor_split`` of the batch into ``dp`` parts). At the end of an epoch a shorter
    last batch is dropped when ``drop_last`` (the same tail whatever the layout, as long as the
    global batch is the same), else handed out split as evenly as possible.

    Args:
        dataset_size: number of samples.
        dp_rank, dp: this rank and the data-parallel size.
        global_batch: samples per step over all data-parallel ranks.
        seed: the shuffle seed. shuffle, drop_last: as above.
    """

    def __init__(
        self,
        dataset_size: int,
        dp_rank: int,
        dp: int,
        *,
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if dataset_size < 1 or global_batch < 1:
            raise ValueError(f"dataset_size and global_batch must be >= 1, got {dataset_size}, {global_batch}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, {dp})")
        if global_batch % dp:
            raise ValueError(f"global batch {global_batch} does not split evenly over {dp} data-parallel ranks")
        if drop_last and global_batch > dataset_size:
            raise ValueError(f"global batch {global_batch} is larger than the dataset ({dataset_size}) with drop_last")
        self.dataset_size, self.dp_rank, self.dp = dataset_size, dp_rank, dp
        self.global_batch, self.seed, self.shuffle, self.drop_last = global_batch, seed, shuffle, drop_last
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's order already handed out (over all ranks)
        self._order: tuple[int, torch.Tensor] | None = None

    # --- the sequence ------------------------------------------------------------------------

    def order(self, epoch: int) -> torch.Tensor:
        """The visiting order of ``epoch`` (the same on every rank and under every layout)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = (epoch, torch.randperm(self.dataset_size, generator=g))
            else:
                self._order = (epoch, torch.arange(self.dataset_size))
        return self._order[1]

    def _roll(self) -> None:
        left = self.dataset_size - self.consumed
        if left <= 0 or (self.drop_last and left < self.global_batch):
            self.epoch += 1
            self.consumed = 0

    def global_batch_indices(self) -> torch.Tensor:
        """The next global batch (all ranks' samples, in rank order), without advancing."""
        self._roll()
        return self.order(self.epoch)[self.consumed : self.consumed + self.global_batch]

    def peek(self) -> list[int]:
        """This rank's indices of the next global batch, without advancing."""
        batch = self.global_batch_indices()
        return torch.tensor_split(batch, self.dp)[self.dp_rank].tolist()

    def next_batch(self) -> list[int]:
        """This rank's indices of the next global batch; the position moves past it."""
        mine = self.peek()
        self.consumed += len(self.global_batch_indices())
        return mine

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    # --- the position ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The global position, as plain values (the same on every rank at a step boundary)."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_size": self.dataset_size,
            "global_batch": self.global_batch,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dp": self.dp,  # informational: the position does not depend on it
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved global position, under this sampler's ``dp`` and ``dp_rank``.

        The seed and shuffle come from the saved state (they define the order already partly
        consumed); the global batch and drop_last stay this sampler's (a job may change them
        on restart: the position is in samples). Raises ValueError for another dataset size.
        """
        if not isinstance(state, dict) or "consumed" not in state or "epoch" not in state:
            raise ValueError(f"not a ShardedSampler state: {state!r}")
        if state.get("version", 1) > _STATE_VERSION:
            raise ValueError(f"sampler state version {state['version']} is newer than this library's {_STATE_VERSION}")
        if state["dataset_size"] != self.dataset_size:
            raise ValueError(
                f"the saved position is in a dataset of {state['dataset_size']} samples, this one has "
                f"{self.dataset_size}: the position cannot be carried over"
            )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        if not 0 <= self.consumed <= self.dataset_size:
            raise ValueError(f"saved position {self.consumed} is outside the dataset ({self.dataset_size})")
        self._order = None


def continue_at(state: dict[str, Any], dp: int, *, global_batch: int | None = None) -> list[list[int]]:
    """Where each rank of a ``dp``-rank layout continues from a saved position: its indices of
    the next global batch (``global_batch`` defaults to the saved one)."""
    gb = global_batch or state["global_batch"]
    out = []
    for r in range(dp):
        s = ShardedSampler(state["dataset_size"], r, dp, global_batch=gb, drop_last=state["drop_last"])
        s.load_state_dict(state)
        out.append(s.peek())
    return out


# ---------------------------------------------------------------------------------------------
# random generators


def _numpy():
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover - numpy is a dependency of ucpd
        return None


def rng_state(owner: str) -> dict[str, Any]:
    """This rank's generator states as plain values, tagged with ``owner`` — a string naming
    the layout and the rank, e.g. ``f"{layout.describe()}/rank{rank}"``."""
    np = _numpy()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return {
        "owner": owner,
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
        "cuda": cuda,
        "python": random.getstate(),
        "numpy": np.random.get_state() if np is not None else None,
    }


def derived_seed(seed: int, step: int, owner: str) -> int:
    """The seed a rank gets when it cannot have its own generators back: a hash of the job's
    seed, the step and the rank's owner string (63 bits)."""
    digest = hashlib.sha256(f"{seed}/{step}/{owner}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def restore_rng(saved: dict[str, Any] | None, owner: str, *, seed: int, step: int) -> str:
    """Put this rank's generators back: exactly when ``saved`` was captured by the same
    ``owner`` (``"exact"``), else seeded from ``(seed, step, owner)`` (``"reseeded"``)."""
    np = _numpy()
    if isinstance(saved, dict) and saved.get("owner") == owner and saved.get("torch") is not None:
        torch.set_rng_state(torch.frombuffer(bytearray(saved["torch"]), dtype=torch.uint8))
        if saved.get("cuda") and torch.cuda.is_available():
            states = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in saved["cuda"]]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
        if saved.get("python") is not None:
            random.setstate(saved["python"])
        if saved.get("numpy") is not None and np is not None:
            np.random.set_state(saved["numpy"])
        return "exact"
    s = derived_seed(seed, step, owner)
    torch.manual_seed(s)  # CPU and every CUDA device
    random.seed(s)
    if np is not None:
        np.random.seed(s % 2**32)
    return "reseeded"
