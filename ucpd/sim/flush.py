"""The flush at scale: one version of a 70B model written from N nodes to a shared file system.

The saved job is ``recovery.Layout``'s: node ``i`` holds pipeline stage ``i % pp`` (its 8 TP
ranks inside the node): the stage's bf16 weights whole (every data-parallel replica holds them)
and its share of the stage's optimizer state (ZeRO over DP: the stage's tensors' fp32 states,
one flat buffer cut in DP equal ranges). Two plans, bytes counted per node, time from the model:

- ``"node0"`` — ``--flush-writers one``: node 0 fetches every other node's part, consolidates
  and writes everything (the DCP rank-0 pattern);
- ``"owners"`` — ``--flush-writers all``: the real ``team.flush_plan.ShareFlush`` assigns the
  row blocks (``flush_lead.block_bytes``, ``row_blocks``) of every tensor to the nodes, balanced
  and preferring what each holds; a node writes its pieces, reading the bytes it does not hold
  from their holders. ``lose=True`` loses the busiest writer halfway through its share (its
  finished pieces stay) and lets the state machine hand the rest to the others.

Each byte crosses the network at most once in both (checked). The RAM a writer needs is one
piece's window (``ram_at_busiest`` counts the largest piece it was given).
"""

from __future__ import annotations

import time

import numpy as np

from ..team.flush_lead import batch_bytes, block_bytes
from ..team.flush_plan import Piece, ShareFlush, row_blocks
from .recovery import OPTIM_B, WEIGHT_B, Layout

__all__ = ["llama70b_tensors", "simulate"]


def llama70b_tensors(layers: int = 80, hidden: int = 8192, ffn: int = 28672, kv: int = 1024, vocab: int = 128256) -> list[tuple[str, int, int]]:
    """(name, rows, columns) of every parameter of a Llama-3-70B-shaped model (70.6 B)."""
    out = [("embed", vocab, hidden), ("lm_head", vocab, hidden), ("norm", 1, hidden)]
    for i in range(layers):
        out += [(f"l{i}.q", hidden, hidden), (f"l{i}.k", kv, hidden), (f"l{i}.v", kv, hidden), (f"l{i}.o", hidden, hidden),
                (f"l{i}.gate", ffn, hidden), (f"l{i}.up", ffn, hidden), (f"l{i}.down", hidden, ffn),
                (f"l{i}.ln1", 1, hidden), (f"l{i}.ln2", 1, hidden)]
    return out


def _stage_of(name: str, layers: int, pp: int) -> int:
    if name.startswith("l") and "." in name:
        return int(name[1 : name.index(".")]) * pp // layers
    return 0 if name == "embed" else pp - 1


def _pieces(nodes: int, pp: int, layers: int = 80) -> tuple[list[Piece], float]:
    """Row-block pieces of every tensor with the bytes each node holds of them; the state's bytes."""
    lay = Layout(nodes, pp)
    tensors = llama70b_tensors(layers)
    total = float(sum(r * c for _, r, c in tensors) * (WEIGHT_B + OPTIM_B))
    block = block_bytes(int(total), nodes)
    members = [[n for n in range(nodes) if lay.stage(n) == s] for s in range(pp)]
    optim_at = [0] * pp  # running offset of each stage's flat optimizer buffer
    optim_len = [0] * pp
    for name, r, c in tensors:
        optim_len[_stage_of(name, layers, pp)] += r * c * OPTIM_B
    pieces: list[Piece] = []
    whole: dict[tuple[int, int], tuple] = {}  # (stage, bytes) -> the weights' holders, built once
    for name, rows, cols in tensors:
        s = _stage_of(name, layers, pp)
        dp = len(members[s])
        for kind, per in (("w", WEIGHT_B), ("o", OPTIM_B)):
            row_b = cols * per
            base = optim_at[s]
            for r0, r1 in row_blocks(rows, row_b, block):
                nbytes = (r1 - r0) * row_b
                if kind == "w":  # every DP replica of the stage holds the weights whole
                    held = whole.get((s, nbytes)) or whole.setdefault((s, nbytes), tuple((n, nbytes) for n in members[s]))
                else:  # ZeRO: the bytes [lo, hi) of the stage's flat buffer, cut in DP equal ranges
                    lo, hi = base + r0 * row_b, base + r1 * row_b
                    edges = np.arange(dp + 1, dtype=np.int64) * optim_len[s] // dp
                    k0 = int(np.searchsorted(edges, lo, side="right")) - 1
                    k1 = int(np.searchsorted(edges, hi, side="left"))
                    held = tuple((members[s][k], int(min(hi, edges[k + 1]) - max(lo, edges[k]))) for k in range(k0, k1)
                                 if min(hi, edges[k + 1]) > max(lo, edges[k]))
                pieces.append(Piece(len(pieces), f"{kind}:{name}", r0, r1, nbytes, held))
            if kind == "o":
                optim_at[s] += rows * row_b
    return pieces, total


def simulate(nodes: int = 1024, *, plan: str = "owners", fs_bw: float = 100e9, nic_bw: float = 25e9, pp: int = 8,
             lose: bool = False) -> dict:
    """Bytes each node sends, receives and writes, the modelled flush time, and (``lose``) what a
    writer lost halfway through its share costs."""
    pieces, total = _pieces(nodes, pp)
    lookup: dict[int, dict] = {}  # id(held) -> {node: bytes} (the weights' tuples are shared)
    out = {"plan": plan, "nodes": nodes, "state_bytes": total, "pieces": len(pieces), "lost": None, "rewritten_bytes": 0.0}
    if plan == "node0":
        own = sum(min(p.nbytes, sum(b for n, b in p.held if n == 0)) for p in pieces)
        recv = np.zeros(nodes)
        recv[0] = total - own
        sent = np.zeros(nodes)
        for p in pieces:  # the bytes node 0 lacks, from one holder each (the first)
            if not any(n == 0 for n, _ in p.held):
                sent[p.held[0][0]] += p.nbytes
        write = np.zeros(nodes)
        write[0] = total
        window = recv[0]
    else:
        t0 = time.process_time()
        sm = ShareFlush(pieces, {n: {n} for n in range(nodes)}, range(nodes), batch_bytes=batch_bytes(int(total), nodes))
        out["assign_cpu_s"] = time.process_time() - t0  # the lead's assignment (real code)
        victim = max(sm.load, key=lambda n: sm.load[n]) if lose else None
        share, written = sm.load.get(victim, 0), 0
        while not sm.complete and not sm.error:
            for b in sm.ready():
                if b.node == victim and written + b.nbytes > share / 2:
                    sm.on_lost(victim)  # halfway, mid-batch: that batch and the rest go to the others
                    out["lost"], out["rewritten_bytes"], victim = b.node, float(b.nbytes), None
                    continue
                if b.node == victim:
                    written += b.nbytes
                sm.on_done(b.id, [[] for _ in b.pieces])
        assert not sm.error, sm.error
        write, recv, sent = np.zeros(nodes), np.zeros(nodes), np.zeros(nodes)
        window = 0.0
        for pid, w in sm.written_by.items():
            p = sm.pieces[pid]
            write[w] += p.nbytes
            by_node = lookup.get(id(p.held)) or lookup.setdefault(id(p.held), dict(p.held))
            mine = by_node.get(w, 0)
            missing = p.nbytes - min(p.nbytes, mine)
            if not missing:
                continue
            recv[w] += missing
            window = max(window, float(missing))
            others = [(n, b) for n, b in p.held if n != w]
            scale = missing / sum(b for _, b in others)
            for n, b in others:
                sent[n] += b * scale
    crossed = float(sent.sum())
    assert crossed <= total + 1, "a byte crossed the network twice"
    t_net = max(recv.max(), sent.max()) / nic_bw
    t_write = max(total / fs_bw, write.max() / nic_bw)
    mean = total / (nodes - (out["lost"] is not None))  # over the nodes that could write
    out.update({
        "crossed_bytes": crossed, "crossed_over_state": crossed / total,
        "send_max": float(sent.max()), "recv_max": float(recv.max()),
        "write_max": float(write.max()), "write_mean": mean, "write_max_over_mean": float(write.max() / mean),
        "ram_at_busiest": float(window),
        "time_s": float(t_net + t_write) if plan == "node0" else float(max(t_net, t_write)),
        "fs_bw": fs_bw,
    })
    return out
