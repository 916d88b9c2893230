"""Background flush: a sharded version lands on disk consolidated, in the universal format,
readable by the plain safetensors library; flush progress shows in status."""

from __future__ import annotations

import time

import torch
from safetensors import safe_open

from ucpd.format import list_versions, open_version, validate
from ucpd_client import Checkpointer, placement as P


def wait_flushed(flush_dir: str, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(v.step == step and v.state == "complete" for v in list_versions(flush_dir)):
        assert time.monotonic() < deadline, f"step {step} was not flushed"
        time.sleep(0.05)


def test_sharded_big_tensors_flush_consolidated(make_daemon, dirs):
    d = make_daemon("--mem-limit", "512M", "--flush-every", "2")
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 6144, generator=g)  # 24 MiB: streams through the writer in row blocks
    bf = torch.randn(300, 7, generator=g).to(torch.bfloat16)
    ckpts = [Checkpointer(d.run_dir, rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        for step in (1, 2):
            hs = [
                c.snapshot(step, {"big": big.chunk(2, 1)[r].contiguous(), "bf": bf.chunk(2, 0)[r].clone(), "step": step},
                           placements={"big": P.Shard(1, r, 2), "bf": P.Shard(0, r, 2)})
                for r, c in enumerate(ckpts)
            ]
            for h in hs:
                h.wait()
        wait_flushed(dirs["flushed"], 2)
        assert [v.step for v in list_versions(dirs["flushed"])] == [2]  # --flush-every 2
        # the step's directory appears (renamed into place) a moment before the flusher
        # records it as done
        deadline = time.monotonic() + 10
        while (status := ckpts[0].status())["flush"]["last_flushed"] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status["flush"]["last_flushed"] == 2 and status["flush"]["last_error"] is None
    finally:
        for c in ckpts:
            c.close()
    assert validate(dirs["flushed"], 2) == []
    with open_version(dirs["flushed"], 2) as reader:
        files = {reader.tensors[n].file for n in ("big", "bf")}
        path = reader.path
        assert reader.tensors["big"].shape == (1024, 6144)
    found = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as st:
            for k in st.keys():
                found[k] = st.get_tensor(k)
    assert torch.equal(found["big"], big) and torch.equal(found["bf"], bf)


def test_a_restarted_daemon_flushes_the_committed_version_it_never_wrote(make_daemon, dirs):
    d = make_daemon("--mem-limit", "256M", "--flush-every", "1000")  # nothing is due to flush
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(4, {"w": torch.arange(10.0)}).wait()
    assert list_versions(dirs["flushed"]) == []
    d.kill()
    d.start()  # re-adopts step 4, sees it never reached disk, flushes it
    wait_flushed(dirs["flushed"], 4)
    with open_version(dirs["flushed"], 4) as reader:
        assert reader.tensors["w"].shape == (10,)
