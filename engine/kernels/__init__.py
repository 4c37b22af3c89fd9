"""Fast CPU kernels for mlx-lm models (fast.py installs them when a model is loaded), the BLAS
loader (blas.py) and Orchard's native code (native/).

Importing this package imports nothing: `engine/__init__` loads the BLAS (blas.py) before
anything imports MLX.

MLX's CPU backend computes exp with scalar code (about 12 ns an element against 0.45 ns for an
add), which makes the MLP's SiLU and the attention softmax ~40% of a prefill. fastexp.py
builds exp from elementwise ops that `mx.compile` fuses into vectorised loops; on it:
- activation.py: mlx-lm's `swiglu` / `precise_swiglu` (silu(gate) * up), 6-11x faster; and
  exact GELU for the sentence encoder (MLX's `erf` is scalar too), ~20x faster, from a rational
  fit of erf with no exp at all.
- attention.py: mlx-lm's `scaled_dot_product_attention` (MLX's CPU one is its unfused fallback),
  with that exp in the softmax and GQA's query heads as the rows of one matmul per KV head.
- grouped.py: attention over a batch kept in length cohorts (engine/cache/cohorts.py), one
  cohort at a time; installed on every platform, around the fast attention or mlx-lm's own.
- rope.py: `nn.RoPE` from a table of cos and sin by position (MLX's CPU rope is ~10 ops a call,
  each call computing its own), the same bits as MLX's.

Not replaced, measured (bench/RESULTS.md, "Fast CPU kernels"): `mx.fast.rms_norm`, also a
fallback of separate ops on the CPU but not exp-bound, is 0.03-0.13 ms a call in the default
model; the same ops compiled are 2.2x slower on a 128-token chunk and 1.3x at batch-16 decode
(the per-row factor is a broadcast input: MLX's strided, scalar loop), and save under 1% of a
batch-1 decode step.

Off Linux-CPU (Metal and CUDA keep their own kernels), for dtypes or shapes a kernel does not
handle, and under `ORCHARD_FAST_KERNELS=0` everything stays on MLX's and mlx-lm's own.
"""
