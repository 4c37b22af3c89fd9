#!/bin/sh
# MLX's CPU backend on Linux ships a slow reference BLAS; Orchard loads OpenBLAS before mlx
# (engine/kernels/blas.py). This makes sure the library is there. OpenBLAS, not BLIS or MKL, because
# it is the fastest for decode at batch 16 and for prefill, measured by bench/blas.py
# (bench/RESULTS.md, "BLAS choice"); ORCHARD_BLAS chooses another one where it is installed.
[ "$(uname -s)" = "Linux" ] || exit 0
for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib; do
  [ -e "$d/openblas-pthread/libopenblas.so.0" ] && exit 0
done
ldconfig -p 2>/dev/null | grep -q 'libopenblas.so.0' && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing libopenblas0-pthread (fast BLAS for MLX on CPU)..."
  (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 ||
   (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null)) && exit 0
fi
echo "warning: OpenBLAS not found; MLX will use its slow reference BLAS." >&2
echo "  Debian/Ubuntu: sudo apt-get install libopenblas0-pthread" >&2
echo "  Fedora: sudo dnf install openblas-threads   (or set ORCHARD_OPENBLAS=/path/to/libopenblas.so.0)" >&2
exit 0
