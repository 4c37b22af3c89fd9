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
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _loaded = path
    return _loaded


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
