"""Tunables: environment overrides, the override context manager, size parsing."""

import pytest

from ucpd import knobs


@pytest.mark.parametrize("text, value", [("16G", 16 << 30), ("512MiB", 512 << 20), ("1.5g", 3 << 29), ("1048576", 1 << 20), ("0", 0)])
def test_parse_size(text, value):
    assert knobs.parse_size(text) == value


def test_environment_and_override(monkeypatch):
    monkeypatch.setenv("UCPD_COPY_THREADS", "3")
    assert knobs.copy_threads() == 3
    with knobs.override(UCPD_COPY_THREADS=1, UCPD_KEEP=5):
        assert knobs.copy_threads() == 1 and knobs.keep_versions() == 5
    assert knobs.copy_threads() == 3


def test_default_dirs_are_per_user(monkeypatch):
    monkeypatch.delenv("UCPD_RUN_DIR", raising=False)
    monkeypatch.delenv("UCPD_SHM_DIR", raising=False)
    assert knobs.run_dir().endswith(f"ucpd-{knobs.user()}")
    assert knobs.shm_dir(3) == f"/dev/shm/ucpd-{knobs.user()}-3"
