"""Small models of the shipped spec families, sliced by hand (plain torch, no UCL) at any
(tp, pp, dp, ep) layout: every rank's local parameter names, shapes and values, and its ZeRO-1
flat optimizer partitions, from one global state.

Layouts are Megatron's: global rank = tp_rank + tp * (dp_rank + dp * pp_rank); expert
parallelism is carved out of data parallelism (ep_rank = dp_rank % ep, edp_rank = dp_rank // ep).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

H, HEADS, KV, HD, FFN, LAYERS, VOCAB, EXPERTS = 16, 4, 2, 4, 32, 4, 50, 4
DIVISIBLE_BY = 4  # vocabulary padded to a multiple of DIVISIBLE_BY * tp
STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def ranks(self, rank: int) -> dict[str, int]:
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return {"tp_rank": tp_rank, "dp_rank": dp_rank, "pp_rank": pp_rank,
                "ep_rank": dp_rank % self.ep, "edp_rank": dp_rank // self.ep}

    def symbols(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep}


@dataclass(frozen=True)
class P:
    """A global parameter: ``kind`` says how tensor parallelism slices it; ``where`` is
    "first"/"last" (a pipeline end), "layer" (name has {i}) or "expert" (stacked: {i} only)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    where: str
    dtype: torch.dtype = torch.float32


@dataclass
class Family:
    spec: str
    params: list[P]
    symbols: dict[str, int]
    tied: bool = False
    experts_group: bool = False  # ZeRO: expert parameters partitioned over edp
    extra: dict = field(default_factory=dict)

    # -- global state

    def global_names(self) -> list[P]:
        out = []
        for p in self.params:
            if p.where in ("layer", "expert"):
                out += [P(p.name.format(i=i), p.shape, p.kind, p.where, p.dtype) for i in range(LAYERS)]
            else:
                out.append(p)
        return out

    def global_state(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {}
        for p in self.global_names():
            out[f"model.{p.name}"] = torch.randn(p.shape, generator=g).to(p.dtype)
            for s in STATES:
                out[f"optim.{p.name}.{s}"] = torch.randn(p.shape, generator=g)
        return out

    # -- one rank

    def local_params(self, lay: Layout, rank: int) -> list[tuple[str, P, int | None]]:
        """(local name, global parameter, stacked item or None) in the optimizer's order."""
        c = lay.ranks(rank)
        per = LAYERS // lay.pp
        first, last = c["pp_rank"] == 0, c["pp_rank"] == lay.pp - 1
        lo = c["pp_rank"] * per
        out = []
        by_name = {p.name: p for p in self.params}
        if first:
            out.append(("embed.weight", by_name["embed.weight"], None))
        for i in range(lo, lo + per):
            for p in self.params:
                if p.where == "layer":
                    out.append((p.name.format(i=i - lo), P(p.name.format(i=i), p.shape, p.kind, p.where, p.dtype), None))
                elif p.where == "expert":
                    n = EXPERTS // lay.ep
                    for j in range(n):
                        local = p.name.format(i=i - lo).replace("experts.", f"experts.{j}.")
                        out.append((local, P(p.name.format(i=i), p.shape, p.kind, p.where, p.dtype), c["ep_rank"] * n + j))
        if last:
            for p in self.params:
                if p.where == "last":
                    out.append((p.name, p, None))
            if self.tied and lay.pp > 1:  # the last stage's copy of the tied embedding
                out.append(("output.weight", by_name["embed.weight"], None))
        return out

    def rank_tensors(self, lay: Layout, rank: int, glob: dict[str, torch.Tensor]):
        """(model {local name: tensor}, optim {flat name: tensor}) of one rank."""
        c = lay.ranks(rank)
        model = {}
        groups: dict[str, dict[str, list]] = {"": {s: [] for s in STATES}, "experts": {s: [] for s in STATES}}
        for local, p, item in self.local_params(lay, rank):
            model[local] = local_of(p, glob[f"model.{p.name}"], item, lay.tp, c["tp_rank"])
            gname = "experts" if (self.experts_group and p.where == "expert") else ""
            for s in STATES:
                groups[gname][s].append(local_of(p, glob[f"optim.{p.name}.{s}"], item, lay.tp, c["tp_rank"]).reshape(-1))
        optim = {}
        for gname, by_state in groups.items():
            if not by_state[STATES[0]]:
                continue
            size, idx = (lay.dp // lay.ep, c["edp_rank"]) if gname else (lay.dp, c["dp_rank"])
            for s in STATES:
                flat = torch.cat(by_state[s])
                total = -(-flat.numel() // (2 * size)) * (2 * size)  # DeepSpeed: a multiple of 2 * dp
                buf = torch.zeros(total)
                buf[: flat.numel()] = flat
                optim[f"optim.{gname + '.' if gname else ''}{s}"] = buf.chunk(size)[idx].clone()
        return model, optim


def padded_vocab(tp: int) -> int:
    m = DIVISIBLE_BY * tp
    return -(-VOCAB // m) * m


def local_of(p: P, full: torch.Tensor, item: int | None, tp: int, r: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of a global tensor, by plain torch slicing."""
    if item is not None:
        full = full[item]
    k = p.kind
    if k == "rep":
        out = full
    elif k == "col":
        out = full.chunk(tp, 0)[r]
    elif k == "row":
        out = full.chunk(tp, 1)[r]
    elif k == "vocab":
        padded = torch.zeros((padded_vocab(tp),) + tuple(full.shape[1:]), dtype=full.dtype)
        padded[:VOCAB] = full
        out = padded.chunk(tp, 0)[r]
    elif k == "qkv":
        q, kk, v = full.split((HEADS * HD, KV * HD, KV * HD), 0)
        parts = tp if KV % tp == 0 else KV
        j = r if KV % tp == 0 else r // (tp // KV)
        out = torch.cat([q.chunk(tp, 0)[r], kk.chunk(parts, 0)[j], v.chunk(parts, 0)[j]])
    elif k == "gate_up":
        gate, up = full.split((FFN, FFN), 0)
        out = torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]])
    else:
        raise ValueError(k)
    return out.clone()


QKV = (HEADS * HD + 2 * KV * HD, H)
MODEL_SYMBOLS = {"vocab": VOCAB, "hidden": H, "heads": HEADS, "kv_heads": KV, "layers": LAYERS}


def gpt() -> Family:
    return Family(
        "megatron-gpt",
        [
            P("embed.weight", (VOCAB, H), "vocab", "first"),
            P("layers.{i}.attn_norm.weight", (H,), "rep", "layer", torch.bfloat16),
            P("layers.{i}.attn_norm.bias", (H,), "rep", "layer", torch.bfloat16),
            P("layers.{i}.attn.qkv.weight", QKV, "qkv", "layer"),
            P("layers.{i}.attn.qkv.bias", (QKV[0],), "qkv", "layer"),
            P("layers.{i}.attn.proj.weight", (H, HEADS * HD), "row", "layer"),
            P("layers.{i}.attn.proj.bias", (H,), "rep", "layer"),
            P("layers.{i}.mlp_norm.weight", (H,), "rep", "layer", torch.bfloat16),
            P("layers.{i}.mlp_norm.bias", (H,), "rep", "layer", torch.bfloat16),
            P("layers.{i}.mlp.fc1.weight", (FFN, H), "col", "layer"),
            P("layers.{i}.mlp.fc1.bias", (FFN,), "col", "layer"),
            P("layers.{i}.mlp.fc2.weight", (H, FFN), "row", "layer"),
            P("layers.{i}.mlp.fc2.bias", (H,), "rep", "layer"),
            P("final_norm.weight", (H,), "rep", "last", torch.bfloat16),
            P("final_norm.bias", (H,), "rep", "last", torch.bfloat16),
        ],
        {**MODEL_SYMBOLS, "ffn": FFN},
        tied=True,
    )


def llama(fused: bool = True) -> Family:
    mlp = (
        [P("layers.{i}.mlp.gate_up.weight", (2 * FFN, H), "gate_up", "layer")]
        if fused
        else [P("layers.{i}.mlp.gate.weight", (FFN, H), "col", "layer"), P("layers.{i}.mlp.up.weight", (FFN, H), "col", "layer")]
    )
    return Family(
        "llama",
        [
            P("embed.weight", (VOCAB, H), "vocab", "first"),
            P("layers.{i}.attn_norm.weight", (H,), "rep", "layer"),
            P("layers.{i}.attn.qkv.weight", QKV, "qkv", "layer"),
            P("layers.{i}.attn.proj.weight", (H, HEADS * HD), "row", "layer"),
            P("layers.{i}.mlp_norm.weight", (H,), "rep", "layer"),
            *mlp,
            P("layers.{i}.mlp.down.weight", (H, FFN), "row", "layer"),
            P("final_norm.weight", (H,), "rep", "last"),
            P("output.weight", (VOCAB, H), "vocab", "last"),
        ],
        {**MODEL_SYMBOLS, "ffn": FFN, "gate_up_fused": int(fused)},
    )


def mixtral() -> Family:
    return Family(
        "mixtral",
        [
            P("embed.weight", (VOCAB, H), "vocab", "first"),
            P("layers.{i}.attn_norm.weight", (H,), "rep", "layer", torch.bfloat16),
            P("layers.{i}.attn.qkv.weight", QKV, "qkv", "layer"),
            P("layers.{i}.attn.proj.weight", (H, HEADS * HD), "row", "layer"),
            P("layers.{i}.mlp_norm.weight", (H,), "rep", "layer", torch.bfloat16),
            P("layers.{i}.mlp.router.weight", (EXPERTS, H), "rep", "layer"),
            P("layers.{i}.mlp.experts.gate_up.weight", (EXPERTS, 2 * FFN, H), "gate_up", "expert"),
            P("layers.{i}.mlp.experts.down.weight", (EXPERTS, H, FFN), "row", "expert"),
            P("final_norm.weight", (H,), "rep", "last", torch.bfloat16),
            P("output.weight", (VOCAB, H), "vocab", "last"),
        ],
        {**MODEL_SYMBOLS, "ffn": FFN, "experts": EXPERTS},
        experts_group=True,
    )
