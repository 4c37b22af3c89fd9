"""Make MLX's CPU backend use a fast BLAS on Linux.

`mlx[cpu]` links a slow reference BLAS (~5 GFLOP/s for a 1024^3 fp32 matmul). Loading an
optimized library with RTLD_GLOBAL before `mlx` is imported makes its `cblas_sgemm` win symbol
resolution for `libmlx.so`, which is the only BLAS routine the model's matmuls reach.

Which library: `ORCHARD_BLAS` names one, either by name (`openblas`, `blis`, `mkl`), as a path
to a library file, or `off` (MLX's own reference BLAS). Unset, the first of `AUTO_ORDER` that is
installed is loaded. The order is measured, not assumed: bench/blas.py times OpenBLAS, BLIS and
MKL on the model's matmul shapes and forwards (bench/RESULTS.md, "BLAS choice"). OpenBLAS leads
where serving is busiest (decode at batch 16, prefill); BLIS is faster at batch 1-8 but half as
fast at prefill. One symbol means one library per process: a mix (BLIS for decode's few rows,
OpenBLAS for many) is not possible by preloading; it would take a dispatching `cblas_sgemm` of
our own in front of both.

In front of that library sits Orchard's own `cblas_sgemm` (engine/kernels/native/sgemm.c, compiled
on first use): it computes the products of a decode step itself (a few rows of activations times
a weight matrix, read once instead of packed on every call; attention's many tiny products)
and hands every other product (prefill, large batches) to the library. `ORCHARD_FAST_SGEMM=0`
loads the library alone; `ORCHARD_SGEMM_THREADS` sets its threads (default: the CPUs this
process may use); `ORCHARD_SGEMM_MAX_ROWS` the most rows it takes (default `DEFAULT_MAX_ROWS`,
where it stops being faster than OpenBLAS: bench/RESULTS.md, "Small-M sgemm").

Thread counts are the libraries' own variables (OPENBLAS_NUM_THREADS, BLIS_NUM_THREADS,
MKL_NUM_THREADS), read when the library loads. Their defaults were the best measured on an idle
2-core machine (OpenBLAS and MKL: all cores; BLIS: one), so nothing here sets them.

`ORCHARD_OPENBLAS` (a path, or `off`) is the older name of the same switch and is still read
when `ORCHARD_BLAS` is unset.
"""

import ctypes
import glob
import os
import sys

ENV = "ORCHARD_BLAS"
LEGACY_ENV = "ORCHARD_OPENBLAS"
FAST_SGEMM_ENV = "ORCHARD_FAST_SGEMM"
SGEMM_THREADS_ENV = "ORCHARD_SGEMM_THREADS"
SGEMM_ROWS_ENV = "ORCHARD_SGEMM_MAX_ROWS"
DEFAULT_MAX_ROWS = 32

# Where each library's file is found, most specific first. Debian's pthread builds are the ones
# measured (the OpenMP builds would bring a second thread pool next to MLX's own threads); MKL is
# the PyPI wheel (`pip install mkl` puts libmkl_rt in the environment's lib/).
SEARCH_PATTERNS = {
    "openblas": (
        "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/*-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas*.so.0",
        "/usr/lib/libopenblas.so.0",
    ),
    "blis": (
        "/usr/lib/*-linux-gnu/blis-pthread/libblis.so.4",
        "/usr/lib/*-linux-gnu/libblis.so.4",
        "/usr/lib64/libblis*.so.4",
    ),
    "mkl": (
        os.path.join(sys.prefix, "lib", "libmkl_rt.so.*"),
        "/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so.*",
    ),
}

# Tried in this order when ORCHARD_BLAS is unset: setup installs OpenBLAS (measured best for
# batch-16 decode and prefill on a 2-core AMD EPYC, AVX2); BLIS and MKL are only fallbacks, each
# still 20-40x faster than the reference BLAS. Setup never installs MKL (bench/RESULTS.md).
AUTO_ORDER = ("openblas", "blis", "mkl")

_loaded: str | None = None
_sgemm: ctypes.CDLL | None = None


def requested() -> str:
    """What the environment asks for: 'auto', 'off', a library name or a path."""
    value = os.environ.get(ENV) or os.environ.get(LEGACY_ENV) or "auto"
    return value.strip()


def find_library(name: str) -> str | None:
    """The installed file of library `name` ('openblas', 'blis' or 'mkl'), or None."""
    for pattern in SEARCH_PATTERNS[name]:
        matches = sorted(glob.glob(pattern))
        if matches:
            return matches[0]
    return None


def find_blas(choice: str | None = None) -> str | None:
    """The library file `choice` (default: the environment's) resolves to, or None for 'off',
    for a path that does not exist, or when nothing in AUTO_ORDER is installed."""
    choice = requested() if choice is None else choice
    if choice == "off":
        return None
    if choice in SEARCH_PATTERNS:
        return find_library(choice)
    if choice == "auto":
        for name in AUTO_ORDER:
            path = find_library(name)
            if path:
                return path
        return None
    return choice if os.path.exists(choice) else None


def _prepare(path: str) -> None:
    """Library-specific settings that must be in place before it loads."""
    if "mkl_rt" in os.path.basename(path):
        # libmkl_rt's default threading layer wants Intel's libiomp5, which the mkl wheel only
        # pulls in as a separate package; GNU OpenMP (libgomp) is on every Linux with gcc.
        os.environ.setdefault("MKL_THREADING_LAYER", "GNU")


def preload_blas() -> str | None:
    """Load the chosen BLAS globally once; returns its path, or None where not applicable
    (not Linux, 'off', nothing installed) or too late (mlx is already imported)."""
    global _loaded
    if _loaded or not sys.platform.startswith("linux"):
        return _loaded
    if "mlx.core" in sys.modules:
        # Too late to interpose; say so rather than pretend.
        return None
    path = find_blas()
    if path:
        _prepare(path)
        global _sgemm
        if fast_sgemm_wanted():
            _sgemm = _load_sgemm(path)
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _loaded = path
    return _loaded


def fast_sgemm_wanted() -> bool:
    return os.environ.get(FAST_SGEMM_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        return default


def _load_sgemm(blas_path: str) -> ctypes.CDLL | None:
    """Orchard's cblas_sgemm, set to hand other products to `blas_path` and loaded ahead of
    it in the global scope; None (the library alone) where it cannot be built or set up."""
    from engine.kernels.native import build_sgemm

    built = build_sgemm()
    if built is None:
        return None
    # Set up while private, so a library that cannot serve as the fallback never takes over
    # cblas_sgemm; then made global (dlopen promotes an open library), before the BLAS.
    library = ctypes.CDLL(str(built), mode=ctypes.RTLD_LOCAL)
    library.orchard_sgemm_init.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    threads = _env_int(SGEMM_THREADS_ENV, len(os.sched_getaffinity(0)))
    rows = _env_int(SGEMM_ROWS_ENV, DEFAULT_MAX_ROWS)
    if library.orchard_sgemm_init(blas_path.encode(), threads, rows) != 0:
        return None
    library = ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)
    library.orchard_sgemm_backend.restype = ctypes.c_char_p
    return library


def sgemm_library() -> str | None:
    """The file of Orchard's cblas_sgemm when it is loaded, else None."""
    return _sgemm._name if _sgemm is not None else None


def sgemm_backend() -> str | None:
    """The library Orchard's cblas_sgemm hands other products to (None when not loaded)."""
    return _sgemm.orchard_sgemm_backend().decode() if _sgemm is not None else None


def sgemm_max_rows(rows: int) -> int:
    """Let Orchard's cblas_sgemm take products of up to `rows` rows from now on (0: hand
    them all to the library), returning the previous limit: both ways in one process, for
    benchmarks and identity tests. Raises RuntimeError when it is not loaded."""
    if _sgemm is None:
        raise RuntimeError("Orchard's sgemm is not loaded")
    return _sgemm.orchard_sgemm_set_max_rows(rows)


def sgemm_fast() -> bool:
    """Whether Orchard's cblas_sgemm is loaded and computes products itself (its kernels run
    on this CPU and its row limit is above 0)."""
    return _sgemm is not None and bool(_sgemm.orchard_sgemm_fast())


def sgemm_counts() -> tuple[int, int]:
    """Products Orchard's cblas_sgemm computed itself and handed to the library so far."""
    if _sgemm is None:
        return 0, 0
    fast, forwarded = ctypes.c_long(), ctypes.c_long()
    _sgemm.orchard_sgemm_counts(ctypes.byref(fast), ctypes.byref(forwarded))
    return fast.value, forwarded.value


def sgemm_provider() -> str | None:
    """The file whose `cblas_sgemm` the process's global symbol lookup finds first (the one a
    library loaded afterwards, like libmlx.so, binds to), or None if there is none yet."""
    if not sys.platform.startswith("linux"):
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    process = ctypes.CDLL(None)
    try:
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
    except AttributeError:
        return None
    info = DlInfo()
    if not process.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def attention_kernel() -> int | None:
    """The address of Orchard's fused decode attention (engine/kernels/native/attention.c, in the
    same library as its cblas_sgemm) where that library is loaded and this CPU runs it, else
    None."""
    if _sgemm is None or not _sgemm.orchard_attention_supported():
        return None
    return ctypes.cast(_sgemm.orchard_attention, ctypes.c_void_p).value
