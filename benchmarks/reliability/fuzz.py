"""Long fuzz run of one target under atheris (coverage-guided libFuzzer for Python).

    .venv/bin/python -m pip install atheris   # once (a wheel for CPython 3.11 on Linux x86-64)
    .venv/bin/python benchmarks/reliability/fuzz.py --target request --cases 100000
    .venv/bin/python benchmarks/reliability/fuzz.py --list

Targets are ``tests/helpers/fuzz_targets.py`` (``TARGETS``): request, reply, reply_schemas,
plan, peer, peer_replies, index, ucp_json, safetensors, unpickle — each decodes one input and
must either succeed or raise its typed error; anything else is a crash, and libFuzzer writes
the input to ``crash-*`` in ``--artifacts``. ``daemon`` starts a real ``ucpd serve``
(temporary run and shm dirs, one committed version) and sends every input to its socket as a
request: each must get a reply, ok or a typed error that is not ``internal``, and the daemon's
slot files must not change.

The ucpd modules (and msgpack's Python layer) are instrumented for coverage; the corpus starts
from ``SEEDS`` (valid inputs) and lives in ``--corpus`` (default: a temporary folder). The run
stops after ``--cases`` executions, under a 2 GiB RSS limit and a 10 s limit per input, and
prints one JSON line: target, cases run, seconds, crash files, coverage (and for daemon:
slot files changed, daemon alive); exit 1 on any crash.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _start_daemon():
    """A ``ucpd serve`` with temporary dirs and one committed version: (proc, run, shm, digests)."""
    import subprocess

    base = tempfile.mkdtemp(prefix="ucpd-fuzz-")
    run, shm = os.path.join(base, "run"), tempfile.mkdtemp(prefix="ucpd-fuzz-shm-", dir="/dev/shm")
    proc = subprocess.Popen([sys.executable, "-m", "ucpd", "serve", "--run-dir", run, "--shm-dir", shm, "--mem-limit", "64M",
                             "--keep", "2"], stdout=subprocess.DEVNULL, stderr=open(os.path.join(base, "daemon.log"), "wb"))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(run, "ucpd.sock")):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the daemon did not start")
        time.sleep(0.05)
    import torch

    from ucpd_client import Checkpointer

    with Checkpointer(run, rank=0, world_size=1, embedded=False, job="fuzz") as ckpt:
        ckpt.snapshot(1, {"w": torch.arange(10000.0)}).wait()
    return proc, run, shm


def _digests(shm: str) -> dict[str, str]:
    import hashlib

    out = {}
    for n in sorted(os.listdir(shm)):
        if n.startswith("slot-"):
            with open(os.path.join(shm, n), "rb") as f:
                out[n] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    return out


def _daemon_target(run: str):
    """Send each input to the daemon at ``run`` as a request; check it is answered, typed."""
    import zmq

    from ucpd import protocol
    from ucpd.errors import ProtocolError, UcpdError

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{os.path.join(run, 'ucpd.sock')}")
    skip = {"shutdown", "drop", "wait"}  # valid forms stop the daemon, drop its version, or wait on purpose

    def target(data: bytes) -> None:
        try:
            if protocol.decode_request(data)[0] in skip:
                return
        except ProtocolError:
            pass
        sock.send(data)
        if not sock.poll(10_000):
            raise RuntimeError(f"no reply from the daemon to {data[:200]!r}")
        _, _, err = protocol.decode_reply(sock.recv())
        if err is not None and (not isinstance(err, UcpdError) or err.code == "internal"):
            raise RuntimeError(f"{data[:200]!r} -> {err!r}")

    return target


def _parent(o) -> None:
    """Run the fuzzer in a child process (libFuzzer exits the process when done), then report;
    for ``daemon``, start the daemon first and check its slots and its health after."""
    import re
    import subprocess

    env = dict(os.environ)
    proc = shm = None
    if o.target == "daemon":
        proc, run, shm = _start_daemon()
        before = _digests(shm)
        env["UCPD_FUZZ_RUN"] = run
    t0 = time.monotonic()
    child = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, capture_output=True, text=True)
    out = {"target": o.target, "seconds": round(time.monotonic() - t0, 1), "exit": child.returncode}
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", child.stderr)
    out["cases"] = int(m.group(1)) if m else None
    out["crashes"] = re.findall(r"Test unit written to (\S+)", child.stderr)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", child.stderr)
    out["coverage"] = {"cov": int(cov[-1][0]), "ft": int(cov[-1][1])} if cov else None
    if proc is not None:
        after = _digests(shm)
        out["slot_files_changed"] = [n for n in before if after.get(n, before[n]) != before[n]]
        out["daemon_alive"] = proc.poll() is None
        proc.terminate()
        proc.wait(30)
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    if child.returncode != 0:
        sys.stderr.write(child.stderr[-4000:])
    print(json.dumps(out), flush=True)
    if child.returncode != 0 or out["crashes"] or out.get("slot_files_changed") or out.get("daemon_alive") is False:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="a name from --list")
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--artifacts", default=os.path.join(ROOT, "benchmarks", "reliability", "crashes"))
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    o = ap.parse_args()
    names = sorted(TARGET_NAMES) + ["daemon"]
    if o.list or not o.target:
        print("\n".join(names))
        return
    if o.target not in names:
        raise SystemExit(f"unknown target {o.target!r}; one of {names}")
    if not o.child:
        _parent(o)
        return
    import atheris

    from helpers.fuzz_targets import SEEDS, TARGETS
    import ucpd.daemon.index, ucpd.format.header, ucpd.format.safe_unpickle, ucpd.format.spec  # noqa: E401,F401
    import ucpd.team.commit, ucpd.team.frames, ucpd.team.transport  # noqa: E401,F401

    atheris.instrument_all()  # the editable install's custom loader defeats instrument_imports
    fn = _daemon_target(os.environ["UCPD_FUZZ_RUN"]) if o.target == "daemon" else TARGETS[o.target]
    corpus = o.corpus or tempfile.mkdtemp(prefix=f"ucpd-fuzz-{o.target}-")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(o.artifacts, exist_ok=True)
    for i, seed in enumerate(SEEDS[o.target]()):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(seed)
    args = [sys.argv[0], corpus, f"-runs={o.cases}", f"-max_len={o.max_len}", "-rss_limit_mb=2048", "-timeout=10",
            f"-artifact_prefix={o.artifacts.rstrip('/')}/", "-print_final_stats=1"]
    atheris.Setup(args, fn)
    atheris.Fuzz()


TARGET_NAMES = ["peer", "index", "reply", "request", "safetensors", "ucp_json", "unpickle"]

if __name__ == "__main__":
    main()
