"""Orchard's cblas_sgemm (engine/kernels/native/sgemm.c): loaded in front of the BLAS library,
exact to float32 rounding on every shape it takes, the same bits for a row whatever the batch
around it, and everything else handed to the library unchanged."""

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import engine  # noqa: F401  (the BLAS and Orchard's sgemm before mlx)
import engine.kernels.blas as blas
import engine.kernels.native as native

# isort: split
import mlx.core as mx

ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112

# On Linux it must be there (a failed build would otherwise pass unnoticed); elsewhere, or
# switched off, there is nothing to test.
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not blas.fast_sgemm_wanted(),
    reason="Orchard's sgemm is Linux-only, and ORCHARD_FAST_SGEMM=0 switches it off",
)


def sgemm(a, b, *, trans_b=True, alpha=1.0, beta=0.0, c=None, trans_a=False):
    """C = alpha * op(A) op(B) + beta * C through the loaded cblas_sgemm (row-major)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    m = a.shape[1] if trans_a else a.shape[0]
    k = a.shape[0] if trans_a else a.shape[1]
    n = b.shape[0] if trans_b else b.shape[1]
    out = np.zeros((m, n), np.float32) if c is None else np.array(c, dtype=np.float32)
    pointer = ctypes.POINTER(ctypes.c_float)
    blas._sgemm.cblas_sgemm(
        ROW_MAJOR,
        TRANS if trans_a else NO_TRANS,
        TRANS if trans_b else NO_TRANS,
        m,
        n,
        k,
        ctypes.c_float(alpha),
        a.ctypes.data_as(pointer),
        a.shape[1],
        b.ctypes.data_as(pointer),
        b.shape[1],
        ctypes.c_float(beta),
        out.ctypes.data_as(pointer),
        n,
    )
    return out


def assert_close(got, a, b, *, trans_b=True):
    reference = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    bound = np.abs(a.astype(np.float64)) @ np.abs(b.T if trans_b else b).astype(np.float64)
    # Each element's sum in float32: a few ulps of the sum of magnitudes (K terms).
    np.testing.assert_array_less(np.abs(got - reference), bound * 2e-6 + 1e-30)


def test_it_is_loaded_in_front_of_the_blas_and_owns_sgemm():
    assert blas.sgemm_library() is not None, "engine/kernels/native/sgemm.c did not build or load"
    assert blas.sgemm_provider() == os.path.realpath(blas.sgemm_library())
    assert blas.sgemm_backend() == blas.find_blas()
    assert blas.sgemm_library() == str(native.build_sgemm())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 17, blas.DEFAULT_MAX_ROWS])
@pytest.mark.parametrize("n, k", [(1, 1), (3, 7), (4, 8), (9, 13), (192, 576), (577, 64)])
def test_a_times_b_transposed_is_exact_to_float32_rounding(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    assert_close(sgemm(a, b), a, b)


@pytest.mark.parametrize(
    "m, n, k", [(1, 1, 1), (2, 32, 10), (3, 64, 129), (3, 37, 5), (5, 70, 33), (16, 96, 40)]
)
def test_a_times_b_is_exact_to_float32_rounding(m, n, k):
    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    assert_close(sgemm(a, b, trans_b=False), a, b, trans_b=False)


def test_strides_alpha_and_beta():
    rng = np.random.default_rng(1)
    wide_a = rng.standard_normal((5, 40), dtype=np.float32)
    wide_b = rng.standard_normal((9, 40), dtype=np.float32)
    c = rng.standard_normal((5, 9), dtype=np.float32)
    pointer = ctypes.POINTER(ctypes.c_float)
    out = c.copy()
    # A and B are the first 24 columns of wider arrays (lda = ldb = 40).
    blas._sgemm.cblas_sgemm(
        ROW_MAJOR, NO_TRANS, TRANS, 5, 9, 24, ctypes.c_float(0.5),
        wide_a.ctypes.data_as(pointer), 40, wide_b.ctypes.data_as(pointer), 40,
        ctypes.c_float(2.0), out.ctypes.data_as(pointer), 9,
    )  # fmt: skip
    expected = 0.5 * (wide_a[:, :24].astype(np.float64) @ wide_b[:, :24].T) + 2.0 * c
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    # beta 0 never reads C: NaNs there do not leak into the result.
    a, b = wide_a[:, :8].copy(), wide_b[:, :8].copy()
    nan_c = np.full((5, 9), np.nan, np.float32)
    assert np.isfinite(sgemm(a, b, c=nan_c)).all()


def test_a_rows_result_is_the_same_bits_alone_in_a_batch_or_in_fewer_columns():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((blas.DEFAULT_MAX_ROWS, 1536), dtype=np.float32)
    b = rng.standard_normal((1539, 1536), dtype=np.float32)  # threaded, a column tail
    batch = sgemm(a, b)
    for row in (0, 1, 2, 15, blas.DEFAULT_MAX_ROWS - 1):
        assert np.array_equal(sgemm(a[row : row + 1], b)[0], batch[row])
        assert np.array_equal(sgemm(a[: row + 1], b)[row], batch[row])
    assert np.array_equal(sgemm(a, b[5:14])[:, :], batch[:, 5:14])
    probabilities = rng.random((16, 129), dtype=np.float32)
    values = rng.standard_normal((129, 64), dtype=np.float32)
    together = sgemm(probabilities, values, trans_b=False)
    for row in (0, 7, 15):
        alone = sgemm(probabilities[row : row + 1], values, trans_b=False)[0]
        assert np.array_equal(alone, together[row])


def test_what_the_fast_paths_do_not_take_goes_to_the_library_unchanged():
    rng = np.random.default_rng(3)
    many = rng.standard_normal((blas.DEFAULT_MAX_ROWS + 1, 64), dtype=np.float32)
    b = rng.standard_normal((48, 64), dtype=np.float32)
    fast_before, forwarded_before = blas.sgemm_counts()
    assert_close(sgemm(many, b), many, b)  # more rows than the fast paths take
    a = rng.standard_normal((64, 5), dtype=np.float32)
    assert_close(sgemm(a, b, trans_a=True), a.T, b)  # A transposed
    # Row-major C = A B^T asked column-major: C^T = B A^T, B given as the transpose of its
    # column-major reading.
    small = rng.standard_normal((4, 64), dtype=np.float32)
    col = np.zeros((4, 48), np.float32)
    pointer = ctypes.POINTER(ctypes.c_float)
    blas._sgemm.cblas_sgemm(
        COL_MAJOR, TRANS, NO_TRANS, 48, 4, 64, ctypes.c_float(1.0),
        b.ctypes.data_as(pointer), 64, small.ctypes.data_as(pointer), 64,
        ctypes.c_float(0.0), col.ctypes.data_as(pointer), 48,
    )  # fmt: skip
    assert_close(col, small, b)
    fast_after, forwarded_after = blas.sgemm_counts()
    assert (fast_after, forwarded_after - forwarded_before) == (fast_before, 3)
    sgemm(small, b)
    assert blas.sgemm_counts()[0] == fast_before + 1


def test_callers_on_several_threads_at_once_each_get_their_product():
    rng = np.random.default_rng(4)
    shapes = ((16, 576), (1536, 576))
    cases = [tuple(rng.standard_normal(s, dtype=np.float32) for s in shapes) for _ in range(4)]
    expected = [sgemm(a, b) for a, b in cases]
    failures = []

    def run(index: int) -> None:
        a, b = cases[index]
        for _ in range(20):
            if not np.array_equal(sgemm(a, b), expected[index]):
                failures.append(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_mlx_matmuls_reach_it():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 576), dtype=np.float32)
    w = rng.standard_normal((1536, 576), dtype=np.float32)
    before = blas.sgemm_counts()[0]
    result = np.array(mx.array(x) @ mx.array(w).T)
    assert blas.sgemm_counts()[0] > before
    assert_close(result, x, w)


def test_switched_off_the_library_serves_mlx_alone():
    code = (
        "import os, engine.kernels.blas as b; import mlx.core as mx; "
        "print(b.sgemm_library(), os.path.realpath(b.sgemm_provider() or '') "
        "== os.path.realpath(b.find_blas()))"
    )
    env = {**os.environ, blas.FAST_SGEMM_ENV: "0"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["None", "True"]


def test_no_compiler_means_no_library(monkeypatch, caplog):
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert native.build_sgemm() is None
    assert "no C compiler" in caplog.text


def test_a_build_that_fails_is_reported_and_leaves_nothing(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "sgemm.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    assert native.build_sgemm() is None
    assert "did not build" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


@pytest.mark.slow
def test_the_default_model_greedy_tokens_are_the_same_with_and_without_it(smollm2_path):
    from engine.models.loader import load_model
    from tests.engine.conftest import greedy, make_request, run_batched

    loaded = load_model(smollm2_path, name="smollm2")
    rng = np.random.default_rng(6)
    # Real text's continuations (the model's own top-2 gaps), 8 tokens each in a batch of 4
    # (sgemm's fast paths), EOS ignored; then steps of 33 rows (past its default 32: the
    # library's) from short prompts: the library computes their large products both ways, so
    # 3 tokens show the hand-over and the smaller products kept beside it.
    tokenizer = loaded.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
    prompts = [tokenizer.encode(t) for t in texts]
    many = [[int(t) for t in rng.integers(100, 49000, 3)] for _ in range(33)]

    def run() -> list[list[int]]:
        small = run_batched(
            loaded,
            [make_request(f"t{i}", p, greedy(8, ignore_eos=True)) for i, p in enumerate(prompts)],
        )
        large = run_batched(
            loaded,
            [make_request(f"r{i}", p, greedy(3, ignore_eos=True)) for i, p in enumerate(many)],
        )
        return [small.tokens(f"t{i}") for i in range(len(prompts))] + [
            large.tokens(f"r{i}") for i in range(len(many))
        ]

    assert blas.sgemm_fast()
    before = blas.sgemm_counts()[0]
    with_it = run()
    assert blas.sgemm_counts()[0] > before
    previous = blas.sgemm_max_rows(0)
    try:
        assert not blas.sgemm_fast()
        before = blas.sgemm_counts()[0]
        without = run()
        assert blas.sgemm_counts()[0] == before
    finally:
        blas.sgemm_max_rows(previous)
    assert with_it == without
