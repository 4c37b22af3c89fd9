"""Orchard's MLX engine. Core modules import no Django (see ARCHITECTURE.md).

Importing this package loads OpenBLAS first on Linux, so that MLX's CPU backend uses it.
"""

from engine.blas import preload_openblas

preload_openblas()
