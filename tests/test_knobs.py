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
    assert knobs.shm_dir(3).startswith(f"/dev/shm/ucpd-{knobs.user()}-") and knobs.shm_dir(3).endswith("-3")


def test_two_run_dirs_never_share_a_shm_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("UCPD_SHM_DIR", raising=False)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert knobs.shm_dir(0, a) != knobs.shm_dir(0, b)
    assert knobs.shm_dir(0, a) == knobs.shm_dir(0, a) != knobs.shm_dir(1, a)


def test_override_reaches_native_thread_count(monkeypatch):
    from ucpd import native

    monkeypatch.setenv("UCPD_COPY_THREADS", "3")
    assert native.default_threads() == 3
    with knobs.override(UCPD_COPY_THREADS=2):
        assert native.default_threads() == 2 == knobs.copy_threads()
    assert native.default_threads() == 3
    monkeypatch.delenv("UCPD_COPY_THREADS")
    with knobs.override(UCPD_COPY_THREADS=5):
        assert native.default_threads() == 5
