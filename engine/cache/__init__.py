"""Memory for computed state: mlx-lm's cache objects behind one module (mlx_caches.py), the prefix
cache (prefix.py: a radix tree of KV blocks and hybrid-state checkpoints) and the memory budget
that both share (memory.py)."""
