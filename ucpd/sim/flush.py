"""Consolidation at scale: flushing one version of a 70B model from N nodes to a shared file system.

Two plans, bytes counted per node and time from the bandwidth model:

- ``"node0"`` — what ``Team.gather_for_flush`` does today: node 0 fetches every other node's
  part, consolidates and writes everything (the DCP rank-0 pattern).
- ``"owners"`` — what DESIGN.md asks for: every consolidated tensor (row blocks of at most
  ``block`` bytes for the large ones, written with ``pwrite`` at their offsets) is owned by one
  node, assigned largest first to the least-loaded node; each node sends each piece it holds
  to the piece's owner once (one replica of replicated weights is chosen), and owners write.

Each byte crosses the network at most once in both: the check sums what is sent and compares
it with the state's size minus what owners already hold.
"""

from __future__ import annotations

import heapq

import numpy as np

from .recovery import OPTIM_B, WEIGHT_B

__all__ = ["llama70b_tensors", "simulate"]


def llama70b_tensors(layers: int = 80, hidden: int = 8192, ffn: int = 28672, kv: int = 1024, vocab: int = 128256) -> list[tuple[str, int, int]]:
    """(name, rows, columns) of every parameter of a Llama-3-70B-shaped model (70.6 B)."""
    out = [("embed", vocab, hidden), ("lm_head", vocab, hidden), ("norm", 1, hidden)]
    for i in range(layers):
        out += [(f"l{i}.q", hidden, hidden), (f"l{i}.k", kv, hidden), (f"l{i}.v", kv, hidden), (f"l{i}.o", hidden, hidden),
                (f"l{i}.gate", ffn, hidden), (f"l{i}.up", ffn, hidden), (f"l{i}.down", hidden, ffn),
                (f"l{i}.ln1", 1, hidden), (f"l{i}.ln2", 1, hidden)]
    return out


def simulate(nodes: int = 1024, *, plan: str = "owners", fs_bw: float = 100e9, nic_bw: float = 25e9,
             block: int = 256 << 20, seed: int = 0) -> dict:
    """Bytes each node sends, receives and writes, and the modelled flush time."""
    tensors = llama70b_tensors()
    per_param = WEIGHT_B + OPTIM_B
    items = []  # (bytes, rows) per written piece
    for _, rows, cols in tensors:
        nbytes = rows * cols * per_param
        pieces = max(1, -(-nbytes // block)) if plan == "owners" else 1
        pieces = min(pieces, rows)
        items += [nbytes // pieces] * pieces
    total = float(sum(items))
    held = np.full(nodes, total / nodes)  # each node holds 1/N of the unique state (balanced ZeRO)
    if plan == "node0":
        recv = np.zeros(nodes)
        recv[0] = total - held[0]
        sent = held.copy()
        sent[0] = 0.0
        write = np.zeros(nodes)
        write[0] = total
        pieces = len(items)
    else:
        heap = [(0.0, n) for n in range(nodes)]
        load = np.zeros(nodes)
        for nbytes in sorted(items, reverse=True):  # LPT: largest first to the least loaded
            w, n = heapq.heappop(heap)
            load[n] = w + nbytes
            heapq.heappush(heap, (load[n], n))
        write = load
        # a piece's bytes are spread over the nodes holding its shards; the owner holds 1/N of them
        recv = write * (1 - 1 / nodes)
        sent = held * (1 - 1 / nodes)
        pieces = len(items)
    crossed = float(sent.sum())
    assert crossed <= total + 1, "a byte crossed the network twice"
    t_net = max(recv.max(), sent.max()) / nic_bw
    t_write = max(total / fs_bw, write.max() / nic_bw)
    return {
        "plan": plan, "nodes": nodes, "state_bytes": total, "pieces": pieces,
        "crossed_bytes": crossed, "crossed_over_state": crossed / total,
        "send_max": float(sent.max()), "recv_max": float(recv.max()),
        "write_max": float(write.max()), "write_mean": float(write.mean()),
        "write_max_over_mean": float(write.max() / write.mean()),
        "ram_at_busiest": float(recv.max() + held.max()),
        "time_s": float(t_net + t_write) if plan == "node0" else float(max(t_net, t_write)),
        "fs_bw": fs_bw,
    }
