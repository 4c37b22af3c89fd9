"""Orchard's MLX engine. Core modules import no Django (see ARCHITECTURE.md).

Importing this package loads a fast BLAS first on Linux (engine/blas.py), so that MLX's CPU
backend uses it.
"""

from engine.blas import preload_blas

preload_blas()
