"""vLLM's weight-transfer seam served from ucpd: a rollout engine pulls each committed version
of the trainer's weights from the daemons' RAM (``ucpd_client.Weights``) instead of a second
copy pushed by the trainer.

vLLM creates a ``WeightTransferEngine`` per worker from ``weight_transfer_config.backend``
(``WeightTransferEngineFactory``); this module registers ``"ucpd"``, also as a vLLM general
plugin (the ``vllm.general_plugins`` entry point of the ``vllm`` extra, run in every vLLM
process), or by calling ``register()`` before the engine starts::

    from vllm import LLM
    from vllm.config import WeightTransferConfig
    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="ucpd"))
    llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"job": "train", "prefix": "model."}))
    llm.update_weights(WeightTransferUpdateRequest(update_info={"step": step}))   # or {} for the newest

The trainer does nothing for it: its snapshots are the versions. ``init_info``: ``job`` (whose
versions), ``run_dir`` (this node's daemon; default ``$UCPD_RUN_DIR``), ``prefix`` (the saved
names to read, handed to vLLM without it: a trainer that snapshots ``{"model": state_dict}``
uses ``"model."``), ``bucket_bytes``. Each update reads the saved tensors under ``prefix`` in
buckets of at most ``bucket_bytes`` (views into one reused buffer of that size: the receiving
side's extra memory), each bucket pulled under a lease, every chunk checked, then handed to
``model.load_weights`` (vLLM fuses QKV and gate/up, shards for its TP, converts the dtype).
A restarted engine catches up with ``update_info={}`` (the newest committed step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ucpd.dtypes import dtype as lookup_dtype

from ..weights import BUCKET_BYTES, Weights

BACKEND = "ucpd"

try:  # the real bases where vLLM is installed; plain ones otherwise (the module still imports)
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine as _Engine, WeightTransferInitInfo as _InitInfo, WeightTransferUpdateInfo as _UpdateInfo,
    )
except Exception:  # pragma: no cover - depends on the environment
    _Engine, _InitInfo, _UpdateInfo = object, object, object


@dataclass
class UcpdInitInfo(_InitInfo):
    job: str
    run_dir: str | None = None
    prefix: str = ""
    bucket_bytes: int = BUCKET_BYTES


@dataclass
class UcpdUpdateInfo(_UpdateInfo):
    step: int | None = None  # None: the newest committed step


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


class UcpdWeightTransferEngine(_Engine):
    """A vLLM worker's receiver of a ucpd job's versions (see the module docstring)."""

    init_info_cls = UcpdInitInfo
    update_info_cls = UcpdUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.weights: Weights | None = None
        self.prefix = ""
        self.step: int | None = None  # the step the model holds
        self._buffer: torch.Tensor | None = None
        self._buckets: list[list[tuple[str, str, tuple[int, ...]]]] | None = None  # (saved name, dtype, shape)

    def init_transfer_engine(self, init_info: UcpdInitInfo) -> None:
        if self.weights is not None:
            self.weights.close()
        self.weights = Weights(job=init_info.job, run_dir=init_info.run_dir, bucket_bytes=init_info.bucket_bytes)
        self.prefix, self._buckets = init_info.prefix, None

    def start_weight_update(self) -> None:
        """Weights come in checkpoint format (vLLM's names, unfused): layerwise reloading, as
        vLLM's own checkpoint-format engines do (the model's post-load processing is redone)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: UcpdUpdateInfo) -> None:
        if self.weights is None:
            raise RuntimeError("the ucpd weight transfer engine was not initialized: call init_weight_transfer_engine "
                               "with init_info={'job': ...} first")
        step = update_info.step if update_info.step is not None else self.weights.latest()
        if step is None:
            from ..errors import VersionNotFound

            raise VersionNotFound(f"job {self.weights.job!r} has no committed version yet")
        if self._buckets is None:
            self._buckets = self._plan(step)
        for bucket in self._buckets:
            into, at = {}, 0
            for name, dtype, shape in bucket:
                item = lookup_dtype(dtype).itemsize
                n = math.prod(shape)
                into[name] = self._buffer[at:at + n * item].view(getattr(torch, dtype)).view(shape)
                at = _align(at + n * item)
            self.weights.pull(step, into)
            self.model.load_weights([(name[len(self.prefix):], t) for name, t in into.items()])
        self.step = step

    def _plan(self, step: int) -> list[list[tuple[str, str, tuple[int, ...]]]]:
        """The saved tensors under the prefix, in buckets of at most ``bucket_bytes`` (a larger
        one alone in its bucket), and the one buffer they are read into."""
        described = self.weights.session.describe(step)["tensors"]
        wanted = [(n, d["dtype"], tuple(d["shape"])) for n, d in described.items() if n.startswith(self.prefix)]
        if not wanted:
            raise ValueError(f"step {step} of job {self.weights.job!r} has no tensor named {self.prefix!r}...; "
                             f"saved: {sorted(described)[:5]}")
        buckets: list[list] = []
        used = largest = 0
        for w in wanted:
            size = _align(math.prod(w[2]) * lookup_dtype(w[1]).itemsize)
            if not buckets or (used and used + size > self.weights.bucket_bytes):
                buckets.append([])
                used = 0
            buckets[-1].append(w)
            used += size
            largest = max(largest, used)
        self._buffer = torch.empty(largest, dtype=torch.uint8)
        return buckets

    def shutdown(self) -> None:
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        self._buffer = None


def register() -> None:
    """Register the ``"ucpd"`` backend with vLLM (again: nothing); the vLLM general plugin."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "UcpdWeightTransferEngine")
    except ValueError:  # registered already (the plugin runs once per process, a caller may too)
        pass


__all__ = ["UcpdWeightTransferEngine", "UcpdInitInfo", "UcpdUpdateInfo", "register", "BACKEND"]

