"""Memory for computed state: mlx-lm's cache objects behind one module (mlx_caches.py), the prefix
cache (prefix.py: a radix tree of KV blocks and hybrid-state checkpoints) with its disk tier
(disk/: what memory evicts, in checked files, read back on a hit and after a restart) and the
memory budget that both share (memory.py)."""
