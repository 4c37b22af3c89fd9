"""OpenBLAS is loaded before mlx on Linux (mlx[cpu]'s bundled reference BLAS is ~60x slower)."""

import sys

import pytest

import engine.blas as blas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
def test_openblas_is_loaded_before_mlx_when_installed():
    path = blas.find_openblas()
    assert path is not None, "make setup installs libopenblas0-pthread; it is missing"
    assert blas.preload_openblas() == path
    with open("/proc/self/maps") as maps:
        assert "libopenblas" in maps.read()


def test_preload_refuses_to_pretend_once_mlx_is_imported(monkeypatch):
    import mlx.core  # noqa: F401

    monkeypatch.setattr(blas, "_loaded", None)
    assert blas.preload_openblas() is None
