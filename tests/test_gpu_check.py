"""The GPU check's CPU side: ``benchmarks/gpu/bench_gpu.py`` parses its flags, says plainly that
it needs a GPU and exits 2 without one, and renders its table from whatever sections ran;
``make gpu-check`` stops with a clear message on a machine without a CUDA device. (The check
itself, on a GPU: ``tests/gpu`` and the benchmark, run by ``make gpu-check``.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers.scripts import ROOT, load_benchmark

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the check runs for real there")


@no_cuda
def test_the_benchmark_says_it_needs_a_gpu_and_exits_2_without_one():
    script = os.path.join(ROOT, "benchmarks", "gpu", "bench_gpu.py")
    r = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "make gpu-check" in r.stderr
    r = subprocess.run([sys.executable, script, "--allow-no-gpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0


def test_the_benchmark_parses_its_flags():
    bench = load_benchmark("gpu/bench_gpu.py", "bench_gpu_flags")
    a = bench.parse_args(["--size-gib", "16", "--reps", "3", "--skip-dcp"])
    assert (a.size_gib, a.reps, a.skip_dcp, a.small) == (16.0, 3, True, 10_000)
    q = bench.parse_args(["--quick"])
    assert q.size_gib < 1 and q.small == 1000


def test_the_report_gives_ratios_to_the_floors_of_the_same_run_and_survives_missing_sections():
    bench = load_benchmark("gpu/bench_gpu.py", "bench_gpu_report")
    s = lambda *xs: bench.spread(list(xs))  # noqa: E731
    n = 4 << 30
    res = {
        "floors": {"d2h_flat": s(0.08, 0.078, 0.09), "d2h_per_tensor": s(0.08), "h2d_flat": s(0.08), "h2d_per_tensor": s(0.08),
                   "pin_fresh": s(1.8, 1.7)},
        "snapshot_call": s(0.0003), "snapshot_staged": s(0.082), "snapshot_committed": s(0.092),
        "first_snapshot": {"committed": 2.0}, "restore_same_all": s(0.096), "ucpd_error": "x",
    }
    rows = {r[0]: r for r in bench.report(res, n)}
    assert rows["restore same layout (verify all) / H2D floor"][3].startswith("1.20x")
    assert rows["first snapshot (cold slot) / pinning"][3] == f"{2.0 / 1.75:.2f}x"
    assert rows["DCP load into CUDA tensors (page-cached disk) / H2D floor"][1] == "-"


@no_cuda
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_gpu_check_stops_with_a_clear_message_without_a_gpu():
    r = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no usable CUDA device" in r.stdout and "README" in r.stdout
