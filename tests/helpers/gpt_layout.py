"""A small GPT-like training state at any TP x DP layout, with the expected local tensors
computed independently of UCL (plain torch slicing), for the multi-rank tests.

Per layer: fused QKV with grouped-query attention (q 4 heads, kv 2 heads, head dim 4), a
row-parallel projection, a column-parallel fc1 (+bias), a row-parallel fc2, replicated norms
(bfloat16); a padded, vocabulary-parallel embedding. Adam moments are ZeRO-1 partitions of the
flat buffer of each TP rank's parameters, cut across DP ranks.
"""

from __future__ import annotations

import torch

from ucpd_client import layouts as L, placement as P

VOCAB, H, HEADS, KV, HD, FF, LAYERS = 50, 16, 4, 2, 4, 64, 2
QKV_SIZES = (HEADS * HD, KV * HD, KV * HD)


def param_shapes() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {"embed.weight": ((VOCAB, H), torch.float32)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out[p + "attn.qkv.weight"] = ((sum(QKV_SIZES), H), torch.float32)
        out[p + "attn.proj.weight"] = ((H, H), torch.float32)
        out[p + "mlp.fc1.weight"] = ((FF, H), torch.float32)
        out[p + "mlp.fc1.bias"] = ((FF,), torch.float32)
        out[p + "mlp.fc2.weight"] = ((H, FF), torch.float32)
        out[p + "norm.weight"] = ((H,), torch.bfloat16)
    out["final_norm.weight"] = ((H,), torch.bfloat16)
    return out


def global_tensors(step: int) -> dict[str, torch.Tensor]:
    """Every consolidated tensor of the state at ``step`` (weights and both Adam moments)."""
    g = torch.Generator().manual_seed(step)
    out = {}
    for name, (shape, dtype) in param_shapes().items():
        out[f"model.{name}"] = torch.randn(shape, generator=g).to(dtype)
        out[f"optim.exp_avg.{name}"] = torch.randn(shape, generator=g)
        out[f"optim.exp_avg_sq.{name}"] = torch.rand(shape, generator=g)
    return out


def placement_of(name: str, tp_rank: int, tp: int):
    if name == "embed.weight":
        return L.padded_vocab(tp_rank, tp, VOCAB)
    if name.endswith("qkv.weight"):
        return L.fused_qkv(tp_rank, tp, HEADS, KV, HD)
    if name.endswith(("proj.weight", "fc2.weight")):
        return L.row_parallel(tp_rank, tp)
    if name.endswith(("fc1.weight", "fc1.bias")):
        return L.column_parallel(tp_rank, tp)
    return P.Replicated()


def padded_vocab(tp: int) -> int:
    return L.padded_vocab_size(VOCAB, tp, divisible_by=4)


def local_of(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's local tensor of a parameter, by plain slicing."""
    if name == "embed.weight":
        padded = torch.zeros(padded_vocab(tp), H, dtype=full.dtype)
        padded[:VOCAB] = full
        return padded.chunk(tp, 0)[tp_rank].clone()
    if name.endswith("qkv.weight"):
        q, k, v = full.split(QKV_SIZES, 0)
        kv_parts = tp if KV % tp == 0 else KV
        kv_index = tp_rank if KV % tp == 0 else tp_rank // (tp // KV)
        return torch.cat([q.chunk(tp, 0)[tp_rank], k.chunk(kv_parts, 0)[kv_index], v.chunk(kv_parts, 0)[kv_index]]).clone()
    if name.endswith(("proj.weight", "fc2.weight")):
        return full.chunk(tp, 1)[tp_rank].clone()
    if name.endswith(("fc1.weight", "fc1.bias")):
        return full.chunk(tp, 0)[tp_rank].clone()
    return full.clone()


def rank_state(step: int, rank: int, tp: int, dp: int) -> tuple[dict, dict]:
    """(state, placements) of global rank ``rank`` (tp_rank = rank % tp, dp_rank = rank // tp)."""
    tp_rank, dp_rank = rank % tp, rank // tp
    glob = global_tensors(step)
    model, placements = {}, {}
    for name in param_shapes():
        model[name] = local_of(name, glob[f"model.{name}"], tp_rank, tp)
        placements[f"model.{name}"] = placement_of(name, tp_rank, tp)
    optim = {}
    for moment in ("exp_avg", "exp_avg_sq"):
        params = [
            (f"optim.{moment}.{name}", tuple(model[name].shape), placement_of(name, tp_rank, tp)) for name in param_shapes()
        ]
        part = L.zero_partitions(params, dp, align=2)[dp_rank]
        flat = torch.cat([local_of(name, glob[f"optim.{moment}.{name}"], tp_rank, tp).reshape(-1) for name in param_shapes()])
        buf = torch.zeros(part.of.size)
        buf[: flat.numel()] = flat
        optim[moment] = buf[part.offset : part.offset + part.numel].clone()
        placements[f"optim.{moment}"] = part
    state = {"model": model, "optim": optim, "step": step, "loader": {"rank": rank, "offset": 100 * step + rank}}
    return state, placements


def empty_like_state(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = empty_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 7) if v.dtype.is_floating_point else torch.zeros_like(v)
        else:
            out[k] = None
    return out


def mismatches(got: dict, want: dict, prefix: str = "") -> list[str]:
    """Names whose tensors differ bit for bit (or whose plain values differ)."""
    bad = []
    for k, w in want.items():
        g = got.get(k)
        name = f"{prefix}{k}"
        if isinstance(w, dict):
            bad += mismatches(g, w, name + ".")
        elif isinstance(w, torch.Tensor):
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g.view(-1).view(torch.uint8), w.view(-1).view(torch.uint8)):
                bad.append(name)
        elif g != w:
            bad.append(f"{name}: {g!r} != {w!r}")
    return bad
