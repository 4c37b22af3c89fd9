"""`_orchard_attention`: the MLX primitive around Orchard's fused decode attention, built and
loaded on first use (attention_mlx.cpp; the kernel itself is attention.c, in the sgemm library).

A C++ extension rather than ctypes on evaluated arrays: as a node of MLX's graph it runs on the
CPU stream in order with the other ops, so a forward needs no evaluation per layer (a
throwaway prototype that evaluated its inputs before each call lost to that evaluation what
the kernel saved: bench/RESULTS.md, "Fused decode attention").

Built with CMake and nanobind in MLX's nanobind domain (so MLX's arrays pass as themselves),
against the installed MLX's headers and library, into the native cache folder under a name
that hashes the sources and every version the binary depends on; written atomically like the
sgemm library. Anything missing (cmake, a C++ compiler, nanobind) or failing: None, logged,
and attention stays on the kernels of engine/kernels/attention.py.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from engine.kernels.native import BUILD_TIMEOUT_S, HERE, cache_dir

logger = logging.getLogger(__name__)

NAME = "_orchard_attention"
SOURCES = (HERE / "attention_mlx.cpp", HERE / "attention.h", HERE / "CMakeLists.txt")


def _versions() -> list[str]:
    tools = []
    for command in ([find_cmake(), "--version"], [os.environ.get("CXX") or "c++", "--version"]):
        found = command[0] and shutil.which(command[0])
        tools.append(
            subprocess.run(
                [found, *command[1:]], capture_output=True, text=True, timeout=30, check=False
            ).stdout
            if found
            else ""
        )
    return [
        *tools,
        importlib.metadata.version("mlx"),
        importlib.metadata.version("nanobind"),
        sys.version,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        platform.machine(),
    ]


def extension_path() -> Path:
    key = hashlib.sha256()
    for part in (*(path.read_bytes() for path in SOURCES), *map(str.encode, _versions())):
        key.update(part)
    return cache_dir() / f"{NAME}-{key.hexdigest()[:16]}{sysconfig.get_config_var('EXT_SUFFIX')}"


def find_cmake() -> str | None:
    """The environment's cmake (the `cmake` package of requirements.txt), else the machine's."""
    beside = Path(sys.executable).parent / "cmake"
    return str(beside) if beside.exists() else shutil.which("cmake")


def build_extension() -> Path | None:
    """The built extension (built now if this machine has none yet), or None."""
    try:
        import mlx
        import nanobind

        target = extension_path()
        if target.exists():
            return target
        cmake = find_cmake()
        if cmake is None:
            logger.warning("no cmake: Orchard's fused decode attention is not built")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            build = Path(scratch) / "build"
            steps = (
                [
                    cmake, "-S", str(HERE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}",
                    f"-Dnanobind_ROOT={nanobind.cmake_dir()}",
                    f"-DMLX_ROOT={Path(mlx.__path__[0]) / 'share' / 'cmake' / 'MLX'}",
                ],
                [cmake, "--build", str(build), "--parallel", str(os.cpu_count() or 1)],
            )  # fmt: skip
            for step in steps:
                result = subprocess.run(
                    step, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
                )
                if result.returncode != 0:
                    output = (result.stdout + result.stderr)[-3000:]
                    logger.warning("Orchard's decode attention did not build:\n%s", output)
                    return None
            built = next(build.glob(f"{NAME}*{sysconfig.get_config_var('EXT_SUFFIX')}"))
            os.replace(built, target)
        return target
    except (ImportError, OSError, StopIteration, subprocess.SubprocessError) as exc:
        logger.warning("Orchard's decode attention could not be built: %s", exc)
        return None


@functools.cache
def load_extension(address: int | None) -> ModuleType | None:
    """The extension set to call the kernel at `address` (engine/kernels/blas.py's
    `attention_kernel`), or None (not built, or no kernel to call: Orchard's sgemm library is
    not loaded, or this CPU does not run it)."""
    if address is None:
        return None
    path = build_extension()
    if path is None:
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
        spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        logger.warning("Orchard's decode attention did not load: %s", exc)
        return None
    module.set_kernel(address)
    return module
