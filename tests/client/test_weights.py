"""``Weights``: a receiver that is not a trainer rank reads committed versions from a real daemon
in its own layout — told of each commit by the daemon, a cold pull planned and a warm one that
moves only the sources, fused QKV split over TP 2, a padded vocabulary, another dtype, buckets
with a tensor cut in row blocks, only the named tensors read, a step no longer kept refused, a
step evicted between two buckets and a damaged chunk met as typed errors."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import TEST_JOB
from helpers.waiting import wait_until
from ucpd.errors import ChecksumMismatch, PlacementMismatch, VersionNotFound
from ucpd.rpc import Connection
from ucpd_client import Checkpointer, Weights, placement as P

Q, KV, H, V, VPAD = 64, 16, 32, 50, 56  # query rows, key/value rows, hidden, vocab, vocab padded for TP 2


def trainer_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "attn.qkv.weight": torch.randn(Q + 2 * KV, H, generator=g),  # fused [q; k; v], saved as one global tensor
            "embed.weight": torch.randn(V, H, generator=g),
            "mlp.up.weight": torch.randn(4 * H, H, generator=g),
        },
        "optim": {"mlp.up.weight.exp_avg": torch.randn(4 * H, H, generator=g)},
        "step": step,
    }


def tp2_receiver(r: int) -> tuple[dict, dict, dict]:
    """Rank r of a TP 2 rollout engine: fused QKV split per sub-tensor, a vocabulary padded to
    56 rows split in two, bf16 weights; its own names (no 'model.' prefix)."""
    into = {
        "qkv": torch.zeros((Q + 2 * KV) // 2, H, dtype=torch.bfloat16),
        "embed": torch.full((VPAD // 2, H), 7.0, dtype=torch.bfloat16),
    }
    placements = {"qkv": P.Fused(0, (Q, KV, KV), P.Shard(0, r, 2)), "embed": P.Padded(0, V, P.Shard(0, r, 2))}
    names = {"qkv": "model.attn.qkv.weight", "embed": "model.embed.weight"}
    return into, placements, names


def expected_tp2(step: int, r: int) -> dict:
    m = trainer_state(step)["model"]
    q, k, v = m["attn.qkv.weight"].split((Q, KV, KV))
    half = lambda t: t.chunk(2)[r]  # noqa: E731
    embed = torch.cat([m["embed.weight"], torch.zeros(VPAD - V, H)])
    return {"qkv": torch.cat([half(q), half(k), half(v)]).bfloat16(), "embed": half(embed).bfloat16()}


@pytest.fixture
def trainer(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "2", flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ck:
        ck.daemon = d
        yield ck


def test_a_receiver_is_told_of_each_commit_and_pulls_its_own_layout_warm_after_the_first(trainer):
    with Weights(job=TEST_JOB, run_dir=trainer.daemon.run_dir) as w, w.subscribe() as sub:
        assert w.latest() is None
        for step in (1, 2, 3):
            t0 = time.perf_counter()
            trainer.snapshot(step, trainer_state(step)).wait()
            assert sub.next(timeout=10) == step
            assert sub.notified[step] >= t0
            for r in (0, 1):
                into, placements, names = tp2_receiver(r)
                assert w.pull(step, into, placements=placements, names=names) == step
                want = expected_tp2(step, r)
                assert torch.equal(into["qkv"], want["qkv"]), f"step {step} rank {r}: fused QKV"
                assert torch.equal(into["embed"], want["embed"]), f"step {step} rank {r}: padded vocabulary"
                stats = w.last_pull
                assert stats["warm"] == (0 if step == 1 else stats["buckets"]), stats
                if step == 1:
                    cold = stats["meta_bytes"]
                else:
                    assert stats["meta_bytes"] < cold, (stats, cold)
        assert w.latest() == 3


def test_only_the_named_tensors_are_read_in_buckets_with_a_large_tensor_cut_in_row_blocks(trainer):
    state = trainer_state(1)
    big = torch.randn(1024, 512)  # 2 MiB: four buckets of 512 KiB
    state["model"]["big"] = big
    trainer.snapshot(1, state).wait()
    with Weights(job=TEST_JOB, run_dir=trainer.daemon.run_dir, bucket_bytes=512 << 10) as w:
        into = {"big": torch.empty(1024, 512), "up": torch.empty(4 * H, H, dtype=torch.float16)}
        w.pull(1, into, names={"big": "model.big", "up": "model.mlp.up.weight"})
        assert torch.equal(into["big"], big)
        assert torch.equal(into["up"], state["model"]["mlp.up.weight"].half())
        assert w.last_pull["buckets"] >= 4
        assert w.last_pull["bytes"] == big.numel() * 4 + 4 * H * H * 4  # the optimizer's moments were not read
        # a TP shard of the big one, cut again into row blocks, each at its box in the global tensor
        into = {"big": torch.empty(512, 512)}
        w.pull(1, into, names={"big": "model.big"}, placements={"big": P.Shard(0, 1, 2)})
        assert torch.equal(into["big"], big[512:])


def test_a_step_no_longer_kept_and_an_unknown_name_are_refused_with_what_to_do(trainer):
    for step in (1, 2, 3):
        trainer.snapshot(step, trainer_state(step)).wait()
    with Weights(job=TEST_JOB, run_dir=trainer.daemon.run_dir) as w:
        with pytest.raises(VersionNotFound):
            w.pull(1, {"up": torch.empty(4 * H, H)}, names={"up": "model.mlp.up.weight"})
        with pytest.raises(PlacementMismatch, match="similar saved names: model.mlp.up.weight"):
            w.pull(3, {"up": torch.empty(4 * H, H)}, names={"up": "mlp.up.weight"})
        into = {"up": torch.empty(4 * H, H)}
        w.pull(w.latest(), into, names={"up": "model.mlp.up.weight"})
        assert torch.equal(into["up"], trainer_state(3)["model"]["mlp.up.weight"])


def test_a_version_evicted_between_two_buckets_of_a_pull_is_refused_typed_and_the_daemon_serves_on(make_daemon):
    """Each bucket holds its own lease: a long pull whose step is superseded (``--keep 1``) and
    evicted between two buckets meets VersionNotFound at the next one, saying to pull a newer
    step; the same receiver then pulls the newer step, and leaves no lease behind."""
    d = make_daemon("--mem-limit", "256M", "--keep", "1", flush=False)
    state = lambda step: {"model": {f"w{i}": torch.full((256, 1024), float(10 * step + i)) for i in range(4)}}  # noqa: E731
    into = {f"w{i}": torch.zeros(256, 1024) for i in range(4)}  # 1 MiB each: four buckets of half of 2 MiB
    names = {n: f"model.{n}" for n in into}

    def gone(w, step) -> bool:
        try:
            w.session.describe(step)
        except VersionNotFound:
            return True
        return False

    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ck, \
            Weights(job=TEST_JOB, run_dir=d.run_dir, bucket_bytes=2 << 20) as w, \
            Weights(job=TEST_JOB, run_dir=d.run_dir) as probe:
        ck.snapshot(1, state(1)).wait()
        w.pull(1, into, names=names)
        assert w.last_pull["buckets"] == 4 and all(torch.equal(into[n], state(1)["model"][n]) for n in into)
        real_ask, asked = w._ask, []

        def ask(step, bucket, stats, *rest):  # on the pull-ahead thread, as the third bucket is asked for
            asked.append(step)
            if len(asked) == 3:
                ck.snapshot(2, state(2)).wait()  # step 1 is past --keep 1: evicted once bucket 2's lease goes
                wait_until(lambda: gone(probe, 1), "step 1 to be evicted", 15)
            return real_ask(step, bucket, stats, *rest)

        w._ask = ask
        with pytest.raises(VersionNotFound, match=r"step 1 .*pull a newer step \(Weights.latest\(\)"):
            w.pull(1, into, names=names)
        assert len(asked) == 3
        w._ask = real_ask
        assert torch.equal(into["w0"], state(1)["model"]["w0"])  # the buckets before it were filled whole
        assert w.pull(probe.latest(), into, names=names) == 2
        assert all(torch.equal(into[n], state(2)["model"][n]) for n in into)
        ck.snapshot(3, state(3)).wait()
        wait_until(lambda: gone(probe, 2), "step 2 to be evicted (no lease of its pull left behind)", 15)


def test_a_damaged_source_chunk_raises_checksum_mismatch_and_the_next_step_pulls_whole(trainer):
    """The one-pass copy checksums every chunk it copies: a byte flipped in the daemon's slot
    is met as ChecksumMismatch (never silently wrong weights); the next version pulls whole."""
    trainer.snapshot(1, trainer_state(1)).wait()
    with Connection(trainer.daemon.run_dir) as conn:  # where the saved tensor lies in the slot
        reply = conn.call("restore", rank=0, world_size=1, job=TEST_JOB, targets=[
            {"name": "model.mlp.up.weight", "dtype": "float32", "shape": [4 * H, H], "placement": {"kind": "replicated"}}])
        conn.call("release", lease=reply["lease"])
    (src,) = reply["plan"].sources
    with open(src.path, "r+b") as f:
        f.seek(src.offset + 1000)
        b = f.read(1)
        f.seek(src.offset + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    names = {"up": "model.mlp.up.weight"}
    with Weights(job=TEST_JOB, run_dir=trainer.daemon.run_dir) as w:
        with pytest.raises(ChecksumMismatch):
            w.pull(1, {"up": torch.empty(4 * H, H)}, names=names)
        trainer.snapshot(2, trainer_state(2)).wait()
        into = {"up": torch.empty(4 * H, H)}
        assert w.pull(2, into, names=names) == 2
        assert torch.equal(into["up"], trainer_state(2)["model"]["mlp.up.weight"])
