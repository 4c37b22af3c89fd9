"""Orchard's native code: `sgemm.c`, a `cblas_sgemm` with fast paths for a decode step's
products in front of the BLAS library (engine/kernels/blas.py loads it; bench/RESULTS.md, "Small-M
sgemm", has the measurements).

It is compiled on first use on each machine (a C compiler is already needed: MLX compiles its
CPU kernels with one at run time) into a cache folder, `ORCHARD_NATIVE_CACHE` or
`~/.cache/orchard/native`, under a name that hashes the source, the compiler's version and the
machine, and written atomically, so processes starting together are safe. No compiler, or a
failed build: None, and the BLAS library serves MLX directly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCE = HERE / "sgemm.c"
# Compiled into the same library as SOURCE: the fused decode attention, on sgemm's thread pool.
ATTENTION_SOURCE = HERE / "attention.c"
HEADERS = (HERE / "attention.h", HERE / "vector.h")
CACHE_ENV = "ORCHARD_NATIVE_CACHE"
FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread", "-Wall", "-Wno-psabi")
BUILD_TIMEOUT_S = 120


def cache_dir() -> Path:
    """Where built libraries go: ORCHARD_NATIVE_CACHE, else the user's cache folder, else (a
    home that cannot be written, as for some service accounts) the temporary folder."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "orchard" / "native"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"orchard-native-{os.getuid()}"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def library_path(cc: str) -> Path:
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    key = hashlib.sha256()
    sources = [path.read_bytes() for path in (SOURCE, ATTENTION_SOURCE, *HEADERS)]
    for part in (*sources, version.encode(), platform.machine().encode(), *FLAGS):
        key.update(part if isinstance(part, bytes) else part.encode())
    return cache_dir() / f"orchard-sgemm-{key.hexdigest()[:16]}.so"


def build_sgemm() -> Path | None:
    """The compiled sgemm library (built now if this machine has none yet), or None."""
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler: Orchard's sgemm is not built (the BLAS serves MLX alone)")
        return None
    try:
        target = library_path(cc)
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run(
                [cc, *FLAGS, "-o", str(built), str(SOURCE), str(ATTENTION_SOURCE), "-ldl"],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if result.returncode != 0:
                logger.warning("Orchard's sgemm did not build:\n%s", result.stderr[-2000:])
                return None
            os.replace(built, target)
        return target
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("Orchard's sgemm could not be built: %s", exc)
        return None
