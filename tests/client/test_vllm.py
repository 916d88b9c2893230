"""vLLM's weight-transfer seam fed by ucpd, with the real vLLM CPU engine (``make vllm-env``
builds its side environment, ``.venv-vllm``: vLLM pins another transformers than ours).

A tiny Llama made locally from a config; a trainer process snapshots three versions of it; a
vLLM engine (backend ``"ucpd"``) pulls each as the daemon tells of it and generates greedily:
its tokens equal those of a vLLM engine loaded from the trainer's files of that step. The
engine is SIGKILLed after two versions and started again after the third: it catches up from
``latest()`` and generates the third version's tokens. The reference engine runs beside them
from the start (it loads each step's files once the trainer has written them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from helpers import TEST_JOB
from helpers.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = os.path.join(ROOT, os.environ.get("VLLM_VENV", ".venv-vllm"), "bin", "python")
DRIVER = os.path.join(ROOT, "tests", "helpers", "vllm_driver.py")
# `make vllm-test` (and so CI) sets it: a missing side environment fails there instead of skipping
REQUIRED = os.environ.get("UCPD_VLLM_REQUIRED") == "1"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not REQUIRED and not os.path.exists(PYTHON),
                       reason="no vLLM side environment: `make vllm-env` builds .venv-vllm"),
]


def lines(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()]
    except FileNotFoundError:
        return []


def test_a_vllm_engine_pulls_three_versions_through_ucpd_and_a_restarted_one_catches_up(make_daemon, tmp_path):
    assert os.path.exists(PYTHON), f"no vLLM side environment at {PYTHON}: `make vllm-env` builds it"
    d = make_daemon("--mem-limit", "512M", "--keep", "2", flush=False)
    model, gate, out, ref = (str(tmp_path / n) for n in ("model", "gate", "engine.jsonl", "ref.json"))
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")}
    run = lambda *a, **kw: subprocess.Popen([PYTHON, DRIVER, *a], env=env, **kw)  # noqa: E731
    trainer = run("trainer", model, d.run_dir, TEST_JOB, gate, "3")  # makes the model first
    engine = run("engine", model, d.run_dir, TEST_JOB, out, "follow", "3")
    reference = run("reference", model, ref, "1", "2", "3")
    try:
        wait_until(lambda: lines(out), "the vLLM engine to start", 300)
        for step in (1, 2):
            with open(gate, "w") as f:
                f.write(str(step))
            wait_until(lambda: any(e["step"] == step for e in lines(out)), f"the engine to pull step {step}", 300)
        engine.send_signal(signal.SIGKILL)  # the rollout engine dies ...
        engine.wait()
        with open(gate, "w") as f:
            f.write("3")
        assert trainer.wait(300) == 0
        assert run("engine", model, d.run_dir, TEST_JOB, out, "latest").wait(300) == 0  # ... and catches up
        assert reference.wait(600) == 0
    finally:
        for p in (trainer, engine, reference):
            if p.poll() is None:
                p.kill()
    got = [e for e in lines(out) if e["step"] is not None]
    want = {int(s): t for s, t in json.load(open(ref)).items()}
    assert [e["step"] for e in got] == [1, 2, 3]
    assert got[2]["pid"] != got[0]["pid"]  # the third came to the restarted engine, from latest()
    assert len({tuple(t) for t in want.values()}) == 3  # the versions generate differently
    for e in got:
        assert e["tokens"] == want[e["step"]], f"step {e['step']}: the pulled weights generate otherwise"
