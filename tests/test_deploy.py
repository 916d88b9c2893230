"""The deployment files in ``docs/deploy/`` are real: the systemd unit passes ``systemd-analyze
verify`` (where systemd is installed) and every option of its ``ExecStart`` is one ``ucpd serve``
knows; the Kubernetes manifest parses and its container command line, run for real against
temp dirs in place of its volumes, serves a trainer and answers its liveness probe
(``ucpd status --json``). Each command line runs exactly as written except for paths and ports."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch

from helpers.daemons import free_port
from ucpd_client import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(ROOT, "docs", "deploy", "ucpd.service")
MANIFEST = os.path.join(ROOT, "docs", "deploy", "k8s-daemonset.yaml")
UCPD = [sys.executable, "-m", "ucpd"]


def parse_unit(path: str) -> dict[str, list[tuple[str, str]]]:
    """systemd's syntax: [Section], Key=value (keys may repeat), ``\\`` continues a line, # and ; comment."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    pending = ""
    for raw in open(path):
        line = raw.rstrip("\n")
        if not pending and line.lstrip().startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if not line.strip():
            continue
        if line.startswith("["):
            current = line.strip()[1:-1]
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{key} outside a section"
        sections[current].append((key.strip(), value.strip()))
    return sections


def serve_options() -> set[str]:
    out = subprocess.run(UCPD + ["serve", "--help"], capture_output=True, text=True, check=True).stdout
    return {w.split("=")[0].rstrip(",]") for w in out.replace("[", " ").split() if w.startswith("--")}


def option_names(args: list[str]) -> list[str]:
    return [a.split("=")[0] for a in args if a.startswith("--")]


def run_serving(argv: list[str], run_dir: str, probe: list[str]) -> dict:
    """Start the daemon command line, let a trainer snapshot and restore through it, run the
    probe command, stop it; returns the probe's JSON."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(run_dir, "ucpd.sock")):
            if proc.poll() is not None:
                raise AssertionError(f"{shlex.join(argv)} exited with {proc.returncode}:\n{proc.stdout.read()}")
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        with Checkpointer(run_dir, rank=0, world_size=1, embedded=False, job="deploy-check") as ck:
            w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            ck.snapshot(1, {"w": w}).wait(30)
            back = {"w": torch.zeros(3, 4)}
            assert ck.restore(back) == 1 and torch.equal(back["w"], w)
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _secret(tmp_path) -> str:
    p = tmp_path / "secret"
    p.write_text("0123456789abcdef0123456789abcdef\n")
    p.chmod(0o600)
    return str(p)


def test_systemd_unit(tmp_path, ucpd_isolation, monkeypatch):
    unit = parse_unit(UNIT)
    svc = dict(unit["Service"])
    assert {"Unit", "Service", "Install"} <= set(unit)
    assert svc["RuntimeDirectory"] == "ucpd" and svc["RuntimeDirectoryMode"] == "0700"
    assert svc["Restart"] == "on-failure" and svc["LoadCredential"].startswith("ucpd-secret:")
    assert svc["Environment"] == "UCPD_SECRET_FILE=%d/ucpd-secret"
    argv = shlex.split(svc["ExecStart"])
    assert argv[0].endswith("/ucpd") and argv[1] == "serve"
    unknown = set(option_names(argv[2:])) - serve_options()
    assert not unknown, f"ExecStart passes options `ucpd serve` does not know: {unknown}"
    assert f"%t/{svc['RuntimeDirectory']}" in argv  # the daemon's run dir is the RuntimeDirectory

    if shutil.which("systemd-analyze"):  # verify as systemd reads it, with the executable that exists here
        text = open(UNIT).read().replace(argv[0], shutil.which("ucpd") or os.path.join(os.path.dirname(sys.executable), "ucpd"))
        copy = tmp_path / "ucpd.service"
        copy.write_text(text)
        done = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
        problems = [ln for ln in (done.stdout + done.stderr).splitlines() if "ucpd.service" in ln]
        assert done.returncode == 0 and not problems, done.stdout + done.stderr

    # run its ExecStart for real: systemd's specifiers and host paths -> this test's dirs
    run_root, state = tmp_path / "run", tmp_path / "state"
    (run_root / "ucpd").mkdir(parents=True, mode=0o700)
    config = tmp_path / "serve.toml"
    config.write_text("")  # a single node: no team keys
    port = str(free_port())
    subst = {"%t": str(run_root), "%S": str(state), "/dev/shm/ucpd": ucpd_isolation + "-unit",
             "/etc/ucpd/serve.toml": str(config), "9400": port}
    args = []
    for a in argv[2:]:
        for k, v in subst.items():
            a = a.replace(k, v)
        args.append(a)
    args = [a if a != "64G" else "256M" for a in args]  # the memory limit of a test
    env_secret = _secret(tmp_path)
    monkeypatch.setenv("UCPD_SECRET_FILE", env_secret)  # as Environment= sets it
    run_dir = str(run_root / "ucpd")
    status = run_serving(UCPD + ["serve"] + args, run_dir, UCPD + ["status", "--json", "--run-dir", run_dir])
    assert status["run_dir"] == run_dir and status["shm_dir"] == subst["/dev/shm/ucpd"]
    assert status["keep"] == 2 and status["metrics_port"] == int(port)
    assert status["jobs"] and "deploy-check" in json.dumps(status["jobs"])


def _daemonset():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    docs = list(yaml.safe_load_all(open(MANIFEST)))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Secret", "DaemonSet"}
    return kinds


def test_k8s_daemonset(tmp_path, ucpd_isolation):
    kinds = _daemonset()
    spec = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    vols = {v["name"]: v for v in spec["volumes"]}
    (c,) = [c for c in spec["containers"] if c["name"] == "ucpd"]
    mounts = {m["mountPath"]: vols[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert mounts["/run/ucpd"]["hostPath"]["path"] == "/run/ucpd"  # shared with the trainer pods
    assert mounts["/dev/shm/ucpd"]["hostPath"]["path"] == "/dev/shm/ucpd"
    secret = mounts["/etc/ucpd"]["secret"]
    assert secret["secretName"] == kinds["Secret"]["metadata"]["name"]
    assert "secret" in kinds["Secret"]["stringData"]
    argv = c["command"] + c["args"]
    assert argv[:2] == ["ucpd", "serve"]
    unknown = set(option_names(argv[2:])) - serve_options()
    assert not unknown, f"the container passes options `ucpd serve` does not know: {unknown}"
    probe = c["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["ucpd", "status"] and c["readinessProbe"]["exec"]["command"] == probe

    # run the container's command line: each volume's mount path -> a temp dir
    port = str(free_port())
    where = {"/run/ucpd": str(tmp_path / "run"), "/dev/shm/ucpd": ucpd_isolation + "-k8s", "/ckpt": str(tmp_path / "ckpt")}
    (tmp_path / "etc").mkdir()
    shutil.copy(_secret(tmp_path), tmp_path / "etc" / secret["items"][0]["path"])
    where["/etc/ucpd"] = str(tmp_path / "etc")

    def local(a: str) -> str:
        for path in sorted(where, key=len, reverse=True):
            if path in a:
                return a.replace(path, where[path])
        return a.replace("=9400", "=" + port).replace("=48G", "=256M")  # a test's port and memory limit

    assert all(m in where or m == "/dev/shm" for m in mounts)
    os.makedirs(where["/run/ucpd"], mode=0o700)
    status = run_serving(UCPD + [local(a) for a in argv[1:]], where["/run/ucpd"], UCPD + [local(a) for a in probe[1:]])
    assert status["run_dir"] == where["/run/ucpd"] and status["shm_dir"] == where["/dev/shm/ucpd"]
    assert status["metrics_port"] == int(port) and status["mem_limit"] == 256 << 20
    assert "deploy-check" in json.dumps(status["jobs"])
