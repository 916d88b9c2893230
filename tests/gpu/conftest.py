"""GPU tests: marked ``gpu`` and skipped, with the reason, where torch sees no CUDA device
(``make gpu-check`` runs them on a machine with one). Every test here goes through the real
path: a real daemon, real shm slots, real CUDA tensors, streams and copies."""

from __future__ import annotations

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "gpu")
    skip = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False): run `make gpu-check` on a GPU machine")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not HAVE_CUDA:
                item.add_marker(skip)


@pytest.fixture
def ckpt(make_daemon):
    from ucpd_client import Checkpointer

    d = make_daemon("--mem-limit", "2G", "--keep", "2", flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ck:
        ck.daemon = d
        yield ck


def two_devices() -> bool:
    return HAVE_CUDA and torch.cuda.device_count() >= 2
