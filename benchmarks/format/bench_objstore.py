#!/usr/bin/env python
"""Flush to an object store vs a plain multipart upload of the same bytes, on a local S3 server.

A moto S3 server (``python -m moto.server``, a child process on loopback) stands in for the
store. Per repetition, in turn (the order rotates), with the same bytes (``--mib`` MiB of fp32
tensors in ``--tensors`` tensors, 4 shard files):

- ``ucpd``: ``write_version("s3://...")``: the format writer into a local staging folder on
  ``--dir`` (as the daemon's flush does), then ``ObjectRoot.publish`` (parallel multipart
  uploads with CRC32C, ``ucp.json``, the commit marker, ``LATEST``);
- ``publish``: ``ObjectRoot.publish`` alone, of a folder already written;
- ``s3fs``: the floor: ``S3FileSystem.put_file`` of the same shard files, same part size and
  parts in flight (s3fs's own multipart upload, no checksums);
- ``boto3``: boto3's transfer manager (``upload_file``, same part size and threads);
- ``fetch`` / ``s3fs-get``: reading it back: ``ObjectRoot.fetch`` (ranged reads, every chunk
  CRC checked) vs ``S3FileSystem.get_file`` of the same objects.

Reported: median seconds and MB/s with the range over the repetitions, and ``ucpd`` and
``publish`` as ratios to ``s3fs`` within each repetition (median and range).

    python benchmarks/format/bench_objstore.py --mib 256 --reps 3 --dir /var/tmp --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine  # noqa: E402


def start_moto(log: str) -> tuple[subprocess.Popen, str]:
    f = open(log, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p0"], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        f.seek(0)
        m = re.search(r"Running on (http://127\.0\.0\.1:\d+)", f.read())
        if m:
            return proc, m.group(1)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the staging folders go")
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      UCPD_OBJECT_PART_BYTES=f"{args.part_mib}M", UCPD_OBJECT_CONCURRENCY=str(args.concurrency))
    proc, endpoint = start_moto(os.path.join(args.dir, "bench-moto.log"))
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    try:
        return run(args, endpoint)
    finally:
        proc.kill()
        proc.wait()


def run(args, endpoint: str) -> int:
    import boto3
    import s3fs
    from boto3.s3.transfer import TransferConfig

    from ucpd.format import REPLICATED, TensorSource, write_version
    from ucpd.format.objstore import ObjectRoot

    part = args.part_mib << 20
    rng = np.random.default_rng(0)
    per = (args.mib << 20) // args.tensors // 4
    arrays = [rng.standard_normal(per, dtype=np.float32) for _ in range(args.tensors)]
    nbytes = sum(a.nbytes for a in arrays)
    sources = [TensorSource(f"t{i}", "float32", a.shape, REPLICATED, a) for i, a in enumerate(arrays)]
    shard = nbytes // 4 + 1

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    fs = s3fs.S3FileSystem()
    tm = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=args.concurrency)
    work = Path(tempfile.mkdtemp(prefix="bench-objstore-", dir=args.dir))
    staged = write_version(work / "staged", 0, sources, shard_bytes=shard, fsync=False)
    files = sorted(p for p in staged.iterdir() if p.name.endswith(".safetensors"))

    def clear() -> None:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            objs = [{"Key": o["Key"]} for o in page.get("Contents") or ()]
            if objs:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objs})
        fs.invalidate_cache()

    def ucpd_flush(rep: int) -> None:
        write_version(f"s3://{bucket}/ucpd-{rep}", 1, sources, shard_bytes=shard)

    def publish(rep: int) -> None:
        ObjectRoot(f"s3://{bucket}/pub-{rep}").publish(staged, 0)

    def s3fs_put(rep: int) -> None:
        for f in files:
            fs.put_file(str(f), f"{bucket}/s3fs-{rep}/{f.name}", chunksize=part, max_concurrency=args.concurrency)

    def boto3_put(rep: int) -> None:
        for f in files:
            client.upload_file(str(f), bucket, f"boto3-{rep}/{f.name}", Config=tm)

    def fetch(rep: int) -> None:
        out = work / f"fetch-{rep}"
        ObjectRoot(f"s3://{bucket}/pub-{rep}").fetch(0, out)
        shutil.rmtree(out)

    def s3fs_get(rep: int) -> None:
        out = work / f"get-{rep}"
        out.mkdir()
        for f in files:
            fs.get_file(f"{bucket}/pub-{rep}/step-0/{f.name}", str(out / f.name))
        shutil.rmtree(out)

    uploads = {"ucpd": ucpd_flush, "publish": publish, "s3fs": s3fs_put, "boto3": boto3_put}
    times: dict[str, list[float]] = {k: [] for k in [*uploads, "fetch", "s3fs-get"]}
    for rep in range(args.reps + 1):  # the first is a warm-up
        names = list(uploads)
        names = names[rep % len(names):] + names[: rep % len(names)]
        for name in names:
            t0 = time.perf_counter()
            uploads[name](rep)
            if rep:
                times[name].append(time.perf_counter() - t0)
        for name, fn in (("fetch", fetch), ("s3fs-get", s3fs_get))[:: 1 if rep % 2 else -1]:
            t0 = time.perf_counter()
            fn(rep)
            if rep:
                times[name].append(time.perf_counter() - t0)
        clear()
        shutil.rmtree(work / "ucpd-stage", ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)

    def mbs(t: float) -> float:
        return nbytes / t / 1e6

    print(f"{nbytes >> 20} MiB in {args.tensors} tensors, 4 shards; part {args.part_mib} MiB, {args.concurrency} in flight; "
          f"{args.reps} repetitions")
    print(f"{'case':10} {'median s':>9} {'MB/s (median, range)':>28} {'/ s3fs (median, range)':>26}")
    out = {"machine": machine(), "bytes": nbytes, "args": vars(args), "seconds": times, "ratios": {}}
    for name, ts in times.items():
        floor = times["s3fs"] if name not in ("fetch", "s3fs-get") else times["s3fs-get"]
        ratios = [t / f for t, f in zip(ts, floor)]
        out["ratios"][name] = ratios
        print(f"{name:10} {statistics.median(ts):9.2f} {mbs(statistics.median(ts)):10.0f} "
              f"({mbs(max(ts)):.0f}-{mbs(min(ts)):.0f}) {statistics.median(ratios):14.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
