"""A fast BLAS is loaded before mlx on Linux (mlx[cpu]'s bundled reference BLAS is ~20-60x
slower), and ORCHARD_BLAS chooses which (bench/blas.py measured the choice)."""

import os
import sys

import pytest

import engine.kernels.blas as blas

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the BLAS preload is Linux-only"
)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.delenv(blas.LEGACY_ENV, raising=False)
    return monkeypatch


@linux_only
def test_the_chosen_blas_is_loaded_before_mlx_and_owns_sgemm():
    if blas.requested() == "off":
        pytest.skip("ORCHARD_BLAS=off here")
    path = blas.find_blas()
    assert path is not None, "make setup installs libopenblas0-pthread; it is missing"
    assert blas.preload_blas() == path
    # libmlx.so binds the first cblas_sgemm of the global scope: this library's, or Orchard's
    # own in front of it (tests/engine/test_sgemm.py) handing it what it does not compute.
    if blas.sgemm_library() is not None:
        assert blas.sgemm_provider() == os.path.realpath(blas.sgemm_library())
        assert blas.sgemm_backend() == path
    else:
        assert blas.sgemm_provider() == os.path.realpath(path)


def test_unset_means_the_measured_winner_where_it_is_installed(clean_env):
    winner = blas.find_library(blas.AUTO_ORDER[0])
    if winner is None:
        pytest.skip(f"{blas.AUTO_ORDER[0]} is not installed here")
    assert blas.find_blas() == winner


def test_off_and_missing_paths_load_nothing(clean_env, tmp_path):
    clean_env.setenv(blas.ENV, "off")
    assert blas.find_blas() is None
    clean_env.setenv(blas.ENV, str(tmp_path / "libnothing.so"))
    assert blas.find_blas() is None


def test_a_path_or_a_name_is_taken_as_given(clean_env, tmp_path):
    library = tmp_path / "libsomeblas.so"
    library.write_bytes(b"")
    clean_env.setenv(blas.ENV, str(library))
    assert blas.find_blas() == str(library)
    clean_env.setenv(blas.ENV, "blis")
    assert blas.find_blas() == blas.find_library("blis")


def test_the_older_orchard_openblas_is_read_when_orchard_blas_is_unset(clean_env, tmp_path):
    clean_env.setenv(blas.LEGACY_ENV, "off")
    assert blas.requested() == "off"
    clean_env.setenv(blas.ENV, "openblas")
    assert blas.requested() == "openblas"


def test_auto_takes_the_first_installed_library_in_order(clean_env, monkeypatch):
    installed = {"blis": "/x/libblis.so.4", "mkl": "/x/libmkl_rt.so.3"}
    monkeypatch.setattr(blas, "find_library", installed.get)
    monkeypatch.setattr(blas, "AUTO_ORDER", ("openblas", "blis", "mkl"))
    assert blas.find_blas("auto") == "/x/libblis.so.4"


def test_mkl_gets_gnu_openmp_unless_told_otherwise(clean_env):
    clean_env.delenv("MKL_THREADING_LAYER", raising=False)
    blas._prepare("/x/libmkl_rt.so.3")
    assert os.environ["MKL_THREADING_LAYER"] == "GNU"
    clean_env.setenv("MKL_THREADING_LAYER", "SEQUENTIAL")
    blas._prepare("/x/libmkl_rt.so.3")
    assert os.environ["MKL_THREADING_LAYER"] == "SEQUENTIAL"


def test_preload_refuses_to_pretend_once_mlx_is_imported(monkeypatch):
    import mlx.core  # noqa: F401

    monkeypatch.setattr(blas, "_loaded", None)
    assert blas.preload_blas() is None
