"""The example GPT trainer, in one process: its placements reassemble the global tensors, its
pieces (vocabulary-parallel cross entropy, ZeRO AdamW, schedule, dropout) do what they say,
and the Megatron layout helpers it uses number ranks and groups as Megatron does."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpt import GPTConfig, RunSpec, TrainConfig, Trainer
from gpt.model import Comm, Dropout, GPTStage, _VocabParallelCrossEntropy, global_init, global_shapes
from gpt.trainer import WarmupCosine, ZeroAdamW
from ucpd.errors import InvalidPlacement
from ucpd.ucl import execute, plan_consolidate, resolve, sources_from
from ucpd_client import layouts as L, placement as P


def consolidate(name, gshape, rank_locals):
    """Reassemble global tensor ``name`` from [(placement, local tensor)] of every rank (UCL)."""
    items, arrays = [], {}
    for i, (p, t) in enumerate(rank_locals):
        arrays[i] = np.ascontiguousarray(t.detach().numpy()).reshape(-1).view(np.uint32)
        items += [(i, f) for f in resolve(name, p, tuple(t.shape))]
    plan = plan_consolidate(name, gshape, sources_from(items)[name])
    out = np.zeros(math.prod(gshape), np.uint32)
    execute(plan, arrays, out)
    return torch.from_numpy(out.view(np.float32).reshape(gshape))


@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 2), (1, 1, 3), (2, 1, 1)])
def test_every_placement_reassembles_the_global_weights_and_moments(tp, pp, dp):
    """Each rank's local tensors (plain slicing of the global init) under the placements the
    trainer snapshots — TP, padded vocabulary, fused GQA QKV, pipeline names, ZeRO partitions —
    consolidate to the global tensors, padding dropped."""
    spec = RunSpec(tp=tp, pp=pp, dp=dp, train=TrainConfig(global_batch=4 * dp, micro_batch=4))
    trainers = [Trainer(spec, r, connect=False) for r in range(spec.world)]
    for t in trainers:  # moments := the parameters' own values, to check the Flat placements
        t.opt.exp_avg.copy_(t.opt.flat[t.opt.lo : t.opt.hi])
        t.opt.exp_avg_sq.copy_(t.opt.flat[t.opt.lo : t.opt.hi] * 2)
    cfg = spec.model
    states = [t.state() for t in trainers]
    for name, gshape in global_shapes(cfg).items():
        want = global_init(cfg, name)
        model = [(pl[f"model.{name}"], st["model"][name]) for st, pl in states if name in st["model"]]
        assert torch.equal(consolidate(name, gshape, model), want), name
        for moment, factor in (("exp_avg", 1), ("exp_avg_sq", 2)):
            flat = [(pl[f"optim.{moment}"], st["optim"][moment]) for st, pl in states if name in st["model"]]
            got = consolidate(f"optim.{name}.{moment}", gshape, flat)
            assert torch.equal(got, want * factor), (name, moment)


def test_vocab_parallel_cross_entropy_masks_the_padding():
    torch.manual_seed(0)
    logits = torch.randn(6, 56, requires_grad=True)  # 50 real + 6 padding columns
    target = torch.randint(50, (6,))
    got = _VocabParallelCrossEntropy.apply(logits, target, 0, 50, None)
    want = F.cross_entropy(logits[:, :50], target, reduction="none")
    torch.testing.assert_close(got, want)
    got.sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    F.cross_entropy(ref[:, :50], target, reduction="sum").backward()
    torch.testing.assert_close(logits.grad[:, :50], ref.grad[:, :50])
    assert torch.all(logits.grad[:, 50:] == 0)


def test_zero_adamw_matches_torch_adamw():
    lay = L.MegatronLayout()
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(4))
    w_ref, b_ref = (torch.nn.Parameter(p.detach().clone()) for p in (w, b))
    cfg = TrainConfig()
    opt = ZeroAdamW([("w", w), ("b", b)], {"w": P.Replicated(), "b": P.Replicated()}, lay, Comm(lay), cfg, 1)
    ref = torch.optim.AdamW([{"params": [w_ref], "weight_decay": cfg.weight_decay}, {"params": [b_ref], "weight_decay": 0.0}],
                            lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        gw, gb = torch.randn(4, 3, generator=g), torch.randn(4, generator=g)
        w.grad, b.grad = gw.clone(), gb.clone()
        w_ref.grad, b_ref.grad = gw.clone(), gb.clone()
        opt.collect(0)
        opt.step(1e-2)
        ref.step()
    torch.testing.assert_close(w.detach(), w_ref.detach())
    torch.testing.assert_close(b.detach(), b_ref.detach())
    assert w.data_ptr() == opt.flat.data_ptr()  # the parameters live in the flat buffer


def test_schedule_and_dropout():
    s = WarmupCosine(1.0, 0.1, warmup=4, total=20)
    assert [s.lr_at(i) for i in (1, 4)] == [0.25, 1.0]
    assert s.lr_at(20) == pytest.approx(0.1) and s.lr_at(12) == pytest.approx(0.55)
    s.step(), s.step()
    t = WarmupCosine(1.0, 0.1, 4, 20)
    t.load_state_dict(s.state_dict())
    assert t.step() == s.lr_at(3)
    d1, d2 = Dropout(0.5, 1, layer=3, site=1), Dropout(0.5, 1, layer=3, site=1)
    d1.where = d2.where = (7, 2)
    x = torch.ones(2, 4, 8)
    assert torch.equal(d1(x), d2(x))  # a function of (seed, step, micro-batch, layer, site)
    d2.where = (7, 3)
    assert not torch.equal(d1(x), d2(x))


def test_single_process_training_learns():
    t = Trainer(RunSpec(train=TrainConfig(steps=8)), 0)
    losses = [t.train_step() for _ in range(8)]
    assert losses[0] == pytest.approx(math.log(50), rel=0.02)  # uniform over the vocabulary
    assert losses[-1] < losses[0] - 0.7


def test_megatron_layout_of_rank_and_groups():
    lay = L.MegatronLayout.of_rank(5, tp=2, pp=2, dp=2, num_layers=4)
    assert (lay.tp_rank, lay.dp_rank, lay.pp_rank, lay.rank) == (1, 0, 1, 5)
    assert lay.tp_group == [4, 5] and lay.dp_group == [5, 7] and lay.pp_group == [1, 5]
    assert (lay.prev_stage, lay.next_stage, lay.is_last_stage) == (1, None, True)
    assert list(lay.stage_layers) == [2, 3] and lay.name("layers.1.mlp.fc1.weight") == "layers.3.mlp.fc1.weight"
    groups = lay.all_groups()
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.describe() == "TP2xPP2xDP2"
    parts = L.zero_partitions([("a", (3, 3)), ("b", (5,))], 2)
    assert lay.zero([("a", (3, 3)), ("b", (5,))]) == parts[0]
    with pytest.raises(InvalidPlacement, match="rank 8"):
        L.MegatronLayout.of_rank(8, tp=2, pp=2, dp=2)


def test_stage_parameters_carry_global_names():
    cfg = GPTConfig()
    lay = L.MegatronLayout.of_rank(2, tp=2, pp=2, num_layers=cfg.layers)
    names = [n for n, _ in GPTStage(cfg, Comm(lay, connect=False)).global_parameters()]
    assert names[0] == "layers.2.ln1.weight" and names[-1] == "lm_head.weight"
    assert "embed.weight" not in names
