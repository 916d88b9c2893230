"""A real S3 API server on loopback for the object-store tests, and a proxy in front of it that
cuts connections, answers errors or holds requests on cue.

``MotoServer`` runs moto's server mode (``python -m moto.server``) as a child process on a free
port. ``FaultProxy`` forwards HTTP/1.1 requests to it and, for the requests a rule matches,
instead drops the connection after reading part of the body (a network cut mid-upload), answers
``500 InternalError`` (a struggling server: clients retry) or ``403 AccessDenied`` (no retry:
a failure at once), or holds the request until
released (a stalled upload, during which a test kills the daemon). It also checks the
``x-amz-checksum-crc32c`` header of every request body against the body itself: moto keeps
but does not verify those checksums, so the proxy is what proves they are right.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import threading
import time
from base64 import b64encode
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import crc32c

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoServer:
    """``python -m moto.server -p0`` on 127.0.0.1; ``url`` once it listens."""

    def __init__(self, log_path: str) -> None:
        self.log = open(log_path, "w+")
        env = {**os.environ, **FAKE_CREDENTIALS}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p0"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            self.log.seek(0)
            m = re.search(r"Running on http://127\.0\.0\.1:(\d+)", self.log.read())
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.log.seek(0)
                raise RuntimeError(f"moto server did not start:\n{self.log.read()[-4000:]}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@dataclass
class Rule:
    """Requests this rule takes: ``method`` and a regex on the path+query; ``times`` of them
    (-1: all until removed), after letting the first ``after`` pass. ``action``: "drop", "error",
    "deny" or "hold"."""

    action: str
    method: str = "PUT"
    pattern: str = ""
    times: int = 1
    after: int = 0
    passed: int = 0
    hits: int = 0
    released: threading.Event = field(default_factory=threading.Event)
    seen: threading.Event = field(default_factory=threading.Event)

    def takes(self, method: str, target: str) -> bool:
        if method != self.method or re.search(self.pattern, target) is None:
            return False
        if self.passed < self.after:
            self.passed += 1
            return False
        return self.times < 0 or self.hits < self.times


class FaultProxy:
    """An HTTP proxy to ``upstream`` on a free loopback port (``url``)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.checked = 0  # request bodies whose x-amz-checksum-crc32c matched
        self.unchecked: list[str] = []  # PUTs of data without one
        self.bad_checksums: list[str] = []
        self.faults = 0
        self.seen: list[str] = []  # "METHOD /bucket/key?query" of every request, in order
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            for r in self.rules:
                r.released.set()
            self.rules.clear()

    def close(self) -> None:
        self.clear()
        self.server.shutdown()
        self.server.server_close()

    def _rule_for(self, method: str, target: str) -> Rule | None:
        with self.lock:
            for r in self.rules:
                if r.takes(method, target):
                    r.hits += 1
                    self.faults += 1
                    return r
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        with self.lock:
            self.seen.append(f"{h.command} {h.path}")
        rule = self._rule_for(h.command, h.path)
        if rule is not None and rule.action == "drop":
            h.rfile.read(n // 2)  # half the body arrived, then the connection is gone
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        body = h.rfile.read(n) if n else b""
        if rule is not None and rule.action == "hold":
            rule.seen.set()
            rule.released.wait(300)
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if rule is not None and rule.action in ("error", "deny"):
            code, status = ("InternalError", 500) if rule.action == "error" else ("AccessDenied", 403)
            err = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(err)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(err)
            return
        if h.command == "PUT" and body:
            want = h.headers.get("x-amz-checksum-crc32c")
            with self.lock:
                if want is None:
                    self.unchecked.append(h.path)
                elif want == b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode():
                    self.checked += 1
                else:
                    self.bad_checksums.append(h.path)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("expect", "connection", "host")}
        headers["Host"] = "%s:%d" % self.upstream
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            conn.request(h.command, h.path, body=body if (body or h.command in ("PUT", "POST")) else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
                h.send_header(k, v)
        h.send_header("Content-Length", resp.getheader("Content-Length", "0") if h.command == "HEAD" else str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


# -- fixtures (imported by the test modules that use them) ----------------------------------------

import uuid  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    srv = MotoServer(str(tmp_path_factory.mktemp("moto") / "moto.log"))
    yield srv
    srv.close()


@pytest.fixture
def s3(moto_server, monkeypatch):
    """A new bucket, reached through a FaultProxy: the AWS variables (fake credentials,
    ``AWS_ENDPOINT_URL_S3`` at the proxy) are set for this process and the daemons it starts.
    ``url``: ``s3://<bucket>/ckpt``; ``proxy``; ``client``: boto3 straight to moto (no faults)."""
    import boto3
    import s3fs

    for k, v in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    proxy = FaultProxy(moto_server.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    monkeypatch.setenv("UCPD_OBJECT_PART_BYTES", "5M")  # small files still go as multipart uploads
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")  # botocore's tries per request (s3fs retries on top): faults heal, failing tests end sooner
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would keep another test's endpoint
    bucket = f"ucpd-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=moto_server.url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    yield SimpleNamespace(url=f"s3://{bucket}/ckpt", bucket=bucket, proxy=proxy, client=client)
    proxy.close()
    s3fs.S3FileSystem.clear_instance_cache()
