"""Placements for common parallel layouts, so trainers rarely write one by hand.

Megatron-style tensor/pipeline/expert parallelism::

    from ucpd.ucl import layouts as L   # or ``from ucpd_client import layouts as L`` (the same helpers)
    L.column_parallel(tp_rank, tp)                 # fc1 / qkv weight [out, in]: split out
    L.row_parallel(tp_rank, tp)                    # fc2 / proj weight [out, in]: split in
    L.fused_qkv(tp_rank, tp, num_heads=32, num_kv_heads=8, head_dim=128)
    L.padded_vocab(tp_rank, tp, vocab_size=50257)  # embedding / output layer
    L.global_layer_name("layers.3.mlp.fc1.weight", L.pipeline_layer_offset(pp_rank, pp, 32))
    L.expert(L.expert_index(ep_rank, n_local, i), name="layers.0.mlp.experts.fc1.weight")

ZeRO partition tables::

    L.zero_partitions([("w1", (1024, 512)), ("b1", (1024,))], dp=8, align=2)[dp_rank]

A whole rank at once (its coordinates, groups, layer names and ZeRO partition)::

    lay = L.MegatronLayout.of_rank(rank, tp=2, pp=2, dp=2, num_layers=32)
    lay.tp_group, lay.dp_group, lay.next_stage, lay.name("layers.0.attn.qkv.weight")
    lay.zero([(name, local_shape, placement), ...], align=2)

Every helper returns ``ucpd.ucl`` placement objects (``ucpd_client.placement``). Pure UCL (it
imports only ``ucpd.errors`` and ``ucpd.ucl.placements``): spec files (``ucpd.ucl.spec``) use it,
and the trainer library names its helpers in ``ucpd_client.layouts``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Sequence

from ..errors import InvalidPlacement
from .placements import Flat, FlatBuffer, FlatEntry, Fused, Padded, Placement, Replicated, Shard, Stacked

__all__ = [
    "MegatronLayout", "ParamSpec", "column_parallel", "expert", "expert_index", "fused_gate_up", "fused_qkv",
    "global_layer_name", "padded_vocab", "padded_vocab_size", "pipeline_layer_offset", "row_parallel",
    "zero3_param", "zero_buffer", "zero_partitions",
]

# ---------------------------------------------------------------------------------------------
# tensor parallelism


def _tp(tp_rank: int, tp: int) -> None:
    if not (isinstance(tp, int) and tp >= 1 and isinstance(tp_rank, int) and 0 <= tp_rank < tp):
        raise InvalidPlacement(f"tensor-parallel rank {tp_rank!r} must be in [0, {tp!r})")


def column_parallel(tp_rank: int, tp: int) -> Placement:
    """Column-parallel linear (weight ``[out, in]`` and bias ``[out]``): split dim 0."""
    _tp(tp_rank, tp)
    return Shard(0, tp_rank, tp) if tp > 1 else Replicated()


def row_parallel(tp_rank: int, tp: int) -> Placement:
    """Row-parallel linear weight ``[out, in]``: split dim 1 (its bias is replicated)."""
    _tp(tp_rank, tp)
    return Shard(1, tp_rank, tp) if tp > 1 else Replicated()


def fused_qkv(
    tp_rank: int, tp: int, num_heads: int, num_kv_heads: int, head_dim: int, *, dim: int = 0
) -> Fused:
    """A fused QKV weight/bias whose local tensor is ``cat([q_local, k_local, v_local], dim)``.

    Query heads are split across ``tp``; key/value heads too when ``num_kv_heads`` is a
    multiple of ``tp``, else (``tp`` a multiple of ``num_kv_heads``, grouped-query attention
    with few KV heads) each rank holds the one KV head its query heads use, replicated over
    ``tp // num_kv_heads`` ranks. The global tensor is ``cat([q, k, v], dim)``.

    Megatron-core interleaves q/k/v per query group inside each rank's tensor; that layout is
    this one only when each rank holds a single query group (``num_kv_heads == tp``).
    """
    _tp(tp_rank, tp)
    if num_heads % tp:
        raise InvalidPlacement(f"num_heads {num_heads} is not divisible by tp {tp}")
    q = Shard(dim, tp_rank, tp)
    if num_kv_heads % tp == 0:
        kv: Placement = Shard(dim, tp_rank, tp)
    elif tp % num_kv_heads == 0:
        kv = Shard(dim, tp_rank // (tp // num_kv_heads), num_kv_heads)
    else:
        raise InvalidPlacement(
            f"num_kv_heads {num_kv_heads} and tp {tp}: one must divide the other"
        )
    sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    return Fused(dim, sizes, (q, kv, kv))


def fused_gate_up(tp_rank: int, tp: int, ffn_hidden: int, *, dim: int = 0) -> Fused:
    """A fused gate/up projection (SwiGLU ``[2 * ffn, hidden]``), each half split across tp."""
    _tp(tp_rank, tp)
    return Fused(dim, (ffn_hidden, ffn_hidden), Shard(dim, tp_rank, tp))


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: ``vocab_size`` rounded up to ``divisible_by * tp``."""
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def padded_vocab(tp_rank: int, tp: int, vocab_size: int, *, dim: int = 0, value: int | float = 0) -> Padded:
    """A vocabulary-parallel embedding or output layer: the padded vocabulary is split across
    ``tp`` along ``dim``; the global tensor has ``vocab_size`` rows. The padding amount comes
    from the local shape (see :func:`padded_vocab_size`)."""
    _tp(tp_rank, tp)
    inner: Placement = Shard(dim, tp_rank, tp) if tp > 1 else Replicated()
    return Padded(dim, vocab_size, inner, value)


# ---------------------------------------------------------------------------------------------
# pipeline and expert parallelism


def pipeline_layer_offset(
    pp_rank: int, pp: int, num_layers: int, *, layers_per_stage: Sequence[int] | None = None
) -> int:
    """Global index of stage ``pp_rank``'s first layer (even stages unless
    ``layers_per_stage`` lists every stage's count)."""
    if layers_per_stage is not None:
        if len(layers_per_stage) != pp or sum(layers_per_stage) != num_layers:
            raise InvalidPlacement(
                f"layers_per_stage {list(layers_per_stage)} must list {pp} stages summing to {num_layers}"
            )
        return sum(layers_per_stage[:pp_rank])
    if num_layers % pp:
        raise InvalidPlacement(
            f"{num_layers} layers do not split evenly over {pp} stages; pass layers_per_stage"
        )
    return pp_rank * (num_layers // pp)


_LAYER = re.compile(r"(^|\.)(layers)\.(\d+)(?=\.|$)")


def global_layer_name(name: str, layer_offset: int, *, key: str = "layers") -> str:
    """Rename a stage-local name to the global one: ``layers.3.x`` -> ``layers.<3+offset>.x``
    (the first ``<key>.<int>`` component; names without one are returned unchanged)."""
    pattern = _LAYER if key == "layers" else re.compile(rf"(^|\.)({re.escape(key)})\.(\d+)(?=\.|$)")
    return pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}.{int(m.group(3)) + layer_offset}", name, count=1)


def expert_index(ep_rank: int, num_local_experts: int, local_index: int) -> int:
    """Global index of local expert ``local_index`` on expert-parallel rank ``ep_rank``
    (contiguous assignment, as Megatron does)."""
    if not 0 <= local_index < num_local_experts:
        raise InvalidPlacement(f"local expert {local_index} must be in [0, {num_local_experts})")
    return ep_rank * num_local_experts + local_index


def expert(
    index: int,
    *,
    name: str | None = None,
    inner: Placement | None = None,
    count: int | None = None,
    dim: int = 0,
) -> Stacked:
    """One expert's tensor as item ``index`` of the global stacked tensor ``name`` (stacked on
    ``dim``; None: the local name). ``inner`` places the expert's own dims (e.g.
    ``column_parallel`` under expert-tensor-parallelism)."""
    return Stacked(dim, index, inner if inner is not None else Replicated(), count, name)


# ---------------------------------------------------------------------------------------------
# Megatron ranks in one object

ParamSpec = tuple  # (name, local_shape) or (name, local_shape, inner placement)


@dataclass(frozen=True)
class MegatronLayout:
    """One rank's Megatron-style coordinates, with helpers bound to them.

    Global ranks are numbered as Megatron does by default (order ``tp-dp-pp``): tensor-parallel
    rank fastest, then data-parallel, then pipeline stage::

        lay = MegatronLayout.of_rank(rank, tp=2, pp=2, dp=1, num_layers=4)
        lay.tp_group, lay.dp_group, lay.prev_stage, lay.next_stage   # global ranks
        lay.name("layers.1.mlp.fc1.weight")                          # -> layers.3... on stage 1
        lay.zero(params)                                             # this dp rank's ZeRO partition
    """

    tp_rank: int = 0
    tp: int = 1
    pp_rank: int = 0
    pp: int = 1
    num_layers: int | None = None
    layers_per_stage: tuple[int, ...] | None = None
    dp_rank: int = 0
    dp: int = 1

    @classmethod
    def of_rank(
        cls,
        rank: int,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        num_layers: int | None = None,
        layers_per_stage: Sequence[int] | None = None,
    ) -> "MegatronLayout":
        """The coordinates of global ``rank`` in a ``tp x pp x dp`` job (order ``tp-dp-pp``)."""
        for what, n in (("tp", tp), ("pp", pp), ("dp", dp)):
            if not (isinstance(n, int) and n >= 1):
                raise InvalidPlacement(f"{what} must be an int >= 1, got {n!r}")
        world = tp * pp * dp
        if not (isinstance(rank, int) and 0 <= rank < world):
            raise InvalidPlacement(f"rank {rank!r} must be in [0, {world}) for tp {tp} x pp {pp} x dp {dp}")
        lps = tuple(layers_per_stage) if layers_per_stage is not None else None
        return cls(rank % tp, tp, rank // (tp * dp), pp, num_layers, lps, (rank // tp) % dp, dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return self.rank_of(self.tp_rank, self.pp_rank, self.dp_rank)

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        """The global rank at the given coordinates of this job."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    @property
    def tp_group(self) -> list[int]:
        """The global ranks of this rank's tensor-parallel group (same stage, same dp rank)."""
        return [self.rank_of(t, self.pp_rank, self.dp_rank) for t in range(self.tp)]

    @property
    def dp_group(self) -> list[int]:
        """The global ranks that hold the same model part (same tp rank and stage)."""
        return [self.rank_of(self.tp_rank, self.pp_rank, d) for d in range(self.dp)]

    @property
    def pp_group(self) -> list[int]:
        """The global ranks of this rank's pipeline (same tp and dp rank), stage by stage."""
        return [self.rank_of(self.tp_rank, p, self.dp_rank) for p in range(self.pp)]

    @property
    def prev_stage(self) -> int | None:
        """The global rank this rank receives activations from (None on the first stage)."""
        return None if self.pp_rank == 0 else self.rank_of(self.tp_rank, self.pp_rank - 1, self.dp_rank)

    @property
    def next_stage(self) -> int | None:
        """The global rank this rank sends activations to (None on the last stage)."""
        return None if self.pp_rank == self.pp - 1 else self.rank_of(self.tp_rank, self.pp_rank + 1, self.dp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every tensor-, data- and pipeline-parallel group of the job, by kind (each rank
        creates them all, in this order, as ``torch.distributed.new_group`` requires)."""
        coords = [MegatronLayout.of_rank(r, tp=self.tp, pp=self.pp, dp=self.dp) for r in range(self.world_size)]
        out: dict[str, list[list[int]]] = {"tp": [], "dp": [], "pp": []}
        for kind in out:
            for c in coords:
                g = getattr(c, f"{kind}_group")
                if g not in out[kind]:
                    out[kind].append(g)
        return out

    @property
    def stage_layers(self) -> range:
        """The global indices of this stage's layers."""
        if self.num_layers is None:
            raise InvalidPlacement("MegatronLayout needs num_layers to know a stage's layers")
        if self.layers_per_stage is not None:
            n = self.layers_per_stage[self.pp_rank]
        else:
            n = self.num_layers // self.pp
        return range(self.layer_offset, self.layer_offset + n)

    def describe(self) -> str:
        """``TP2xPP2xDP1`` — the job's layout, for logs."""
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}"

    def zero(self, params: Sequence[ParamSpec], *, align: int = 1, param_align: int = 1) -> Flat:
        """This data-parallel rank's ZeRO partition (:func:`zero_partitions`) of the flat buffer
        of ``params`` — (global name, local shape, inner placement) of this model part."""
        return zero_partitions(params, self.dp, align=align, param_align=param_align)[self.dp_rank]

    @property
    def layer_offset(self) -> int:
        if self.pp == 1:
            return 0
        if self.num_layers is None:
            raise InvalidPlacement("MegatronLayout needs num_layers to renumber pipeline layers")
        return pipeline_layer_offset(self.pp_rank, self.pp, self.num_layers, layers_per_stage=self.layers_per_stage)

    def name(self, local_name: str) -> str:
        """The global name of a stage-local parameter name."""
        return global_layer_name(local_name, self.layer_offset)

    def column(self) -> Placement:
        return column_parallel(self.tp_rank, self.tp)

    def row(self) -> Placement:
        return row_parallel(self.tp_rank, self.tp)

    def qkv(self, num_heads: int, num_kv_heads: int, head_dim: int, *, dim: int = 0) -> Fused:
        return fused_qkv(self.tp_rank, self.tp, num_heads, num_kv_heads, head_dim, dim=dim)

    def gate_up(self, ffn_hidden: int, *, dim: int = 0) -> Fused:
        return fused_gate_up(self.tp_rank, self.tp, ffn_hidden, dim=dim)

    def vocab(self, vocab_size: int, *, dim: int = 0, value: int | float = 0) -> Padded:
        return padded_vocab(self.tp_rank, self.tp, vocab_size, dim=dim, value=value)


# ---------------------------------------------------------------------------------------------
# ZeRO


def zero_buffer(params: Sequence[ParamSpec], dp: int, *, align: int = 1, param_align: int = 1) -> FlatBuffer:
    """The flat buffer of a ZeRO parameter group: ``params`` in order, each start rounded up
    to ``param_align`` elements, the end padded to a multiple of ``dp * align``."""
    if dp < 1 or align < 1 or param_align < 1:
        raise InvalidPlacement(f"dp, align and param_align must be >= 1, got {dp}, {align}, {param_align}")
    entries = []
    pos = 0
    for p in params:
        if not isinstance(p, (tuple, list)) or not 2 <= len(p) <= 3:
            raise InvalidPlacement(f"a ZeRO parameter is (name, shape[, inner]), got {p!r}")
        name, shape = p[0], tuple(p[1])
        inner = p[2] if len(p) > 2 else Replicated()
        pos = -(-pos // param_align) * param_align
        entries.append(FlatEntry(name, shape, inner, pos if param_align > 1 else None))
        pos += prod(shape)
    return FlatBuffer(tuple(entries), dp * align)


def zero_partitions(
    params: Sequence[ParamSpec], dp: int, *, align: int = 1, param_align: int = 1
) -> list[Flat]:
    """ZeRO-1/2 (and ZeRO-3 over a flat group): the ``Flat`` placement of each dp rank's
    partition of the group's flat buffer (:func:`zero_buffer`), indexed by dp rank.

    DeepSpeed ZeRO-1/2 pads each group to ``2 * dp`` elements: ``align=2``.
    """
    buf = zero_buffer(params, dp, align=align, param_align=param_align)
    part = buf.size // dp
    return [Flat(r * part, part, buf) for r in range(dp)]


def zero3_param(
    name: str, shape: Sequence[int], dp_rank: int, dp: int, *, inner: Placement | None = None
) -> Flat:
    """ZeRO-3 partition of a single parameter: the flattened parameter padded to a multiple of
    ``dp`` and split evenly; this is rank ``dp_rank``'s part."""
    entry = FlatEntry(name, tuple(shape), inner if inner is not None else Replicated())
    buf = FlatBuffer((entry,), dp)
    part = buf.size // dp
    return Flat(dp_rank * part, part, buf)
