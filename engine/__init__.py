"""Orchard's MLX engine. Core modules import no Django (see ARCHITECTURE.md).

Importing this package loads a fast BLAS first on Linux (engine/kernels/blas.py), so that MLX's CPU
backend uses it.
"""

from engine.kernels.blas import preload_blas

preload_blas()
