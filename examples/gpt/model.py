"""A small decoder-only GPT with Megatron-style tensor and pipeline parallelism.

Per layer (pre-norm): LayerNorm -> attention with a fused, column-parallel QKV projection and
grouped-query heads (``heads`` query heads share ``kv_heads`` key/value heads) -> row-parallel
output projection; LayerNorm -> column-parallel fc1 (+bias) -> GELU -> row-parallel fc2.
The embedding and the output layer are vocabulary-parallel over a padded vocabulary; the
cross entropy is computed on the vocabulary shards (padding logits masked out).

Parameters carry their *global* names (a pipeline stage names its layers by their global
index) and their UCL placements come from ``ucpd_client.layouts`` (:func:`placement_of`).

Everything random is layout-independent: the initial weights are drawn as the global tensors
and sliced; dropout masks come from generators seeded with (seed, step, global micro-batch,
layer, site). So the same job computes the same thing under any TP/PP/DP layout, up to
floating-point summation order when TP changes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ucpd_client import layouts as L, placement as P


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 256
    layers: int = 4
    seq_len: int = 32
    dropout: float = 0.1
    vocab_divisible_by: int = 8
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def padded_vocab(self, tp: int) -> int:
        return L.padded_vocab_size(self.vocab_size, tp, self.vocab_divisible_by)

    def check(self, tp: int, pp: int) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden}, heads {self.heads}, kv_heads {self.kv_heads} do not divide")
        if self.heads % tp or self.kv_heads % tp or self.ffn % tp:
            raise ValueError(f"tp {tp} must divide heads {self.heads}, kv_heads {self.kv_heads} and ffn {self.ffn}")
        if self.layers % pp:
            raise ValueError(f"pp {pp} must divide layers {self.layers}")


# ---------------------------------------------------------------------------------------------
# communication


class Comm:
    """One rank's process groups (None where a group has one rank: nothing to talk to).
    ``connect=False`` builds none (to construct and inspect a rank's model part offline)."""

    def __init__(self, layout: L.MegatronLayout, connect: bool = True):
        self.layout = layout
        self.tp_group = None
        self.dp_group = None
        if connect and layout.world_size > 1:
            import torch.distributed as dist

            groups = layout.all_groups()
            for kind in ("tp", "dp"):
                for ranks in groups[kind]:
                    if len(ranks) > 1:  # every rank creates every group, in the same order
                        g = dist.new_group(ranks)
                        if layout.rank in ranks:
                            setattr(self, f"{kind}_group", g)


def _all_reduce(t: torch.Tensor, group, op=None) -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Sum partial results over the tensor-parallel group; the gradient passes through."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group):
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if group is None else _ReduceFromTP.apply(x, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split by vocabulary across the tensor-parallel group; logits
    of padding rows (global index >= vocab_size) are masked out."""

    @staticmethod
    def forward(ctx, logits, target, start, vocab_size, group):
        import torch.distributed as dist

        n_local = logits.shape[-1]
        cols = torch.arange(start, start + n_local)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
        top = logits.max(dim=-1).values
        if group is not None:
            _all_reduce(top, group, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        e = shifted.exp()
        total = _all_reduce(e.sum(-1), group)
        local = target - start
        mine = (local >= 0) & (local < n_local)
        idx = local.clamp(0, n_local - 1)
        picked = torch.where(mine, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros(()))
        _all_reduce(picked, group)
        ctx.save_for_backward(e / total.unsqueeze(-1), idx, mine)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


# ---------------------------------------------------------------------------------------------
# layers


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows split across tp: weight [out/tp, in]."""

    def __init__(self, in_features: int, out_local: int, bias: bool, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.zeros(out_local, in_features))
        self.bias = nn.Parameter(torch.zeros(out_local)) if bias else None

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.comm.tp_group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split across tp: weight [out, in/tp], bias replicated."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.zeros(out_features, in_local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.comm.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose padded vocabulary is split across tp: weight [padded/tp, hidden]."""

    def __init__(self, cfg: GPTConfig, comm: Comm):
        super().__init__()
        lay = comm.layout
        self.comm = comm
        self.n_local = cfg.padded_vocab(lay.tp) // lay.tp
        self.start = lay.tp_rank * self.n_local
        self.weight = nn.Parameter(torch.zeros(self.n_local, cfg.hidden))

    def forward(self, ids):
        if self.comm.tp_group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.n_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out * (~outside).unsqueeze(-1).to(out.dtype)
        return reduce_from_tp(out, self.comm.tp_group)


def _mix(*values: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "little") >> 1


class Dropout(nn.Module):
    """Dropout whose mask depends on (seed, step, global micro-batch, layer, site) only, so the
    same sample gets the same mask under any layout (the mask is drawn on the whole hidden
    size, which every tensor-parallel rank holds here)."""

    def __init__(self, p: float, seed: int, layer: int, site: int):
        super().__init__()
        self.p, self.seed, self.layer, self.site = p, seed, layer, site
        self.where: tuple[int, int] | None = None  # (step, global micro-batch), set per micro-batch

    def forward(self, x):
        if not self.training or self.p == 0 or self.where is None:
            return x
        g = torch.Generator().manual_seed(_mix(self.seed, *self.where, self.layer, self.site))
        keep = torch.rand(x.shape, generator=g) >= self.p
        return x * (keep.to(x.dtype) * (1.0 / (1.0 - self.p)))


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: Comm):
        super().__init__()
        tp = comm.layout.tp
        self.hq, self.hkv, self.hd = cfg.heads // tp, cfg.kv_heads // tp, cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden, (self.hq + 2 * self.hkv) * self.hd, False, comm)
        self.proj = RowParallelLinear(self.hq * self.hd, cfg.hidden, True, comm)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.hq * self.hd, self.hkv * self.hd, self.hkv * self.hd], -1)
        q = q.reshape(b, s, self.hq, self.hd).transpose(1, 2)
        k = k.reshape(b, s, self.hkv, self.hd).transpose(1, 2).repeat_interleave(self.hq // self.hkv, dim=1)
        v = v.reshape(b, s, self.hkv, self.hd).transpose(1, 2).repeat_interleave(self.hq // self.hkv, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, self.hq * self.hd)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: Comm):
        super().__init__()
        tp = comm.layout.tp
        self.fc1 = ColumnParallelLinear(cfg.hidden, cfg.ffn // tp, True, comm)
        self.fc2 = RowParallelLinear(cfg.ffn // tp, cfg.hidden, True, comm)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: Comm, layer: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg, comm)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg, comm)
        self.drop1 = Dropout(cfg.dropout, cfg.seed, layer, 1)
        self.drop2 = Dropout(cfg.dropout, cfg.seed, layer, 2)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class GPTStage(nn.Module):
    """The part of the model one pipeline stage holds, split over its tensor-parallel group.

    The first stage takes token ids and embeds them; the last returns vocabulary-parallel
    logits (``loss()`` turns them into the mean cross entropy).
    """

    def __init__(self, cfg: GPTConfig, comm: Comm):
        super().__init__()
        lay = comm.layout
        cfg.check(lay.tp, lay.pp)
        self.cfg, self.comm, self.layout = cfg, comm, lay
        if lay.is_first_stage:
            self.embed = VocabParallelEmbedding(cfg, comm)
        self.layers = nn.ModuleList(Block(cfg, comm, i) for i in lay.stage_layers)
        if lay.is_last_stage:
            self.final_norm = nn.LayerNorm(cfg.hidden)
            self.lm_head = ColumnParallelLinear(cfg.hidden, cfg.padded_vocab(lay.tp) // lay.tp, False, comm)

    def at(self, step: int, micro: int) -> None:
        """Name the (step, global micro-batch) of the next forward, for the dropout masks."""
        for m in self.modules():
            if isinstance(m, Dropout):
                m.where = (step, micro)

    def forward(self, x):
        if self.layout.is_first_stage:
            x = self.embed(x)
        for block in self.layers:
            x = block(x)
        if self.layout.is_last_stage:
            x = self.lm_head(self.final_norm(x))
        return x

    def loss(self, logits, target):
        start = self.layout.tp_rank * logits.shape[-1]
        per_token = _VocabParallelCrossEntropy.apply(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), start, self.cfg.vocab_size, self.comm.tp_group
        )
        return per_token.mean()

    def global_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(global name, parameter) in a fixed order."""
        return [(self.layout.name(n), p) for n, p in self.named_parameters()]


# ---------------------------------------------------------------------------------------------
# placements and initial weights


def placement_of(name: str, layout: L.MegatronLayout, cfg: GPTConfig) -> P.Placement:
    """The UCL placement of this rank's local tensor of global parameter ``name``."""
    if name in ("embed.weight", "lm_head.weight"):
        return layout.vocab(cfg.vocab_size)
    if name.endswith("attn.qkv.weight"):
        return layout.qkv(cfg.heads, cfg.kv_heads, cfg.head_dim)
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return layout.row()
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        return layout.column()
    return P.Replicated()


def global_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global (consolidated, unpadded) shape, by global name."""
    h, hd = cfg.hidden, cfg.head_dim
    out = {"embed.weight": (cfg.vocab_size, h)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        out |= {
            p + "ln1.weight": (h,), p + "ln1.bias": (h,),
            p + "attn.qkv.weight": ((cfg.heads + 2 * cfg.kv_heads) * hd, h),
            p + "attn.proj.weight": (h, cfg.heads * hd), p + "attn.proj.bias": (h,),
            p + "ln2.weight": (h,), p + "ln2.bias": (h,),
            p + "mlp.fc1.weight": (cfg.ffn, h), p + "mlp.fc1.bias": (cfg.ffn,),
            p + "mlp.fc2.weight": (h, cfg.ffn), p + "mlp.fc2.bias": (h,),
        }
    out |= {"final_norm.weight": (h,), "final_norm.bias": (h,), "lm_head.weight": (cfg.vocab_size, h)}
    return out


def global_init(cfg: GPTConfig, name: str) -> torch.Tensor:
    """The initial value of a global parameter (GPT-2 style), the same under any layout."""
    shape = global_shapes(cfg)[name]
    if name.endswith(("ln1.weight", "ln2.weight", "final_norm.weight")):
        return torch.ones(shape)
    if len(shape) == 1:
        return torch.zeros(shape)
    std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
    g = torch.Generator().manual_seed(_mix(cfg.seed, name))
    return torch.randn(shape, generator=g) * std


def local_slice(cfg: GPTConfig, name: str, full: torch.Tensor, layout: L.MegatronLayout) -> torch.Tensor:
    """This rank's part of global tensor ``full``, by plain slicing (the placements of
    :func:`placement_of` say the same; the tests check that they agree)."""
    tp, r = layout.tp, layout.tp_rank
    if name in ("embed.weight", "lm_head.weight"):
        padded = torch.zeros(cfg.padded_vocab(tp), full.shape[1], dtype=full.dtype)
        padded[: cfg.vocab_size] = full
        return padded.chunk(tp, 0)[r].clone()
    if name.endswith("attn.qkv.weight"):
        hd = cfg.head_dim
        q, k, v = full.split([cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd], 0)
        return torch.cat([q.chunk(tp, 0)[r], k.chunk(tp, 0)[r], v.chunk(tp, 0)[r]]).clone()
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return full.chunk(tp, 1)[r].clone()
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        return full.chunk(tp, 0)[r].clone()
    return full.clone()


@torch.no_grad()
def initialize(stage: GPTStage) -> None:
    """Fill the stage's parameters with their slices of the global initial weights."""
    for name, p in stage.global_parameters():
        p.copy_(local_slice(stage.cfg, name, global_init(stage.cfg, name), stage.layout))
