"""Each shipped spec family, end to end through a real daemon: every rank of layout A resolves
its placements from the spec and snapshots its hand-sliced local tensors; the ranks of other
layouts restore from the same version and get exactly their hand-sliced tensors, bit for bit
(parameters, and ZeRO-1 flat optimizer partitions)."""

from __future__ import annotations

import torch
from spec_models import Family, Layout, gpt, llama, mixtral
from ucpd_client import Checkpointer

from ucpd.ucl.spec import RankCoords, load_spec


def rank_layout(fam: Family, lay: Layout, rank: int, glob: dict):
    """(state, placements, layout) of one rank, the state built as a trainer would."""
    bound = load_spec(fam.spec).bind(**lay.symbols(), **fam.symbols)
    c = lay.ranks(rank)
    model, optim = fam.rank_tensors(lay, rank, glob)
    resolved = bound.placements(RankCoords(c["tp_rank"], c["pp_rank"], c["dp_rank"]), model)
    state = {"model": resolved.rename(model), **optim}  # optim: flat names such as "optim.exp_avg"
    return state, resolved


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def snapshot(run_dir: str, fam: Family, lay: Layout, step: int, glob: dict) -> None:
    ckpts = [Checkpointer(run_dir, rank=r, world_size=lay.world, embedded=False) for r in range(lay.world)]
    try:
        handles = []
        for r, ck in enumerate(ckpts):
            state, resolved = rank_layout(fam, lay, r, glob)
            handles.append(ck.snapshot(step, state, placements=resolved.placements))
        for h in handles:
            h.wait(timeout=60)
    finally:
        for ck in ckpts:
            ck.close()


def restore_and_check(run_dir: str, fam: Family, lay: Layout, step: int, glob: dict) -> int:
    """Restore every rank of ``lay``; returns the number of tensors checked."""
    checked = 0
    with Checkpointer(run_dir, rank=0, world_size=1, embedded=False) as reader:
        for r in range(lay.world):
            want, resolved = rank_layout(fam, lay, r, glob)
            flat_want = {f"model.{k}": v for k, v in want["model"].items()} | {k: v for k, v in want.items() if k != "model"}
            assert set(flat_want) == set(resolved.placements)
            target = {k: torch.full(resolved.shapes[k], 7, dtype=v.dtype) for k, v in flat_want.items()}
            assert reader.restore(target, step=step, placements=resolved.placements) == step
            bad = [k for k in flat_want if not same_bits(target[k], flat_want[k])]
            assert not bad, f"{fam.spec} {lay} rank {r}: {bad}"
            checked += len(target)
    return checked


FULL = Layout()


def test_megatron_gpt_tp2_pp2_dp2_restores_at_tp4_dp2_and_whole(daemon):
    fam = gpt()  # tied embedding: the last stage's output.weight is embed.weight
    glob = fam.global_state(3)
    snapshot(daemon.run_dir, fam, Layout(tp=2, pp=2, dp=2), 3, glob)
    assert restore_and_check(daemon.run_dir, fam, Layout(tp=4, pp=1, dp=2), 3, glob) > 0  # GQA: 2 kv heads on 4 ranks
    restore_and_check(daemon.run_dir, fam, FULL, 3, glob)


def test_llama_fused_and_separate_gate_up_across_layouts(daemon):
    for step, fam, a, b in (
        (1, llama(fused=True), Layout(tp=1, pp=2, dp=2), Layout(tp=2, pp=4, dp=1)),
        (2, llama(fused=False), Layout(tp=2, pp=4, dp=1), Layout(tp=1, pp=2, dp=2)),
    ):
        glob = fam.global_state(step)
        snapshot(daemon.run_dir, fam, a, step, glob)
        restore_and_check(daemon.run_dir, fam, b, step, glob)
        restore_and_check(daemon.run_dir, fam, FULL, step, glob)


def test_mixtral_experts_restack_across_expert_parallel_layouts(daemon):
    fam = mixtral()  # experts: 2 per rank at ep=2, 1 at ep=4, all 4 at ep=1; ZeRO group over edp
    a, b = Layout(tp=2, pp=1, dp=4, ep=2), Layout(tp=1, pp=2, dp=4, ep=4)
    glob = fam.global_state(5)
    snapshot(daemon.run_dir, fam, a, 5, glob)
    restore_and_check(daemon.run_dir, fam, b, 5, glob)
    restore_and_check(daemon.run_dir, fam, FULL, 5, glob)
