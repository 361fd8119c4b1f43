"""KV-cache tiers: cached prefix blocks that leave the KV cache go to host memory and to disk, and
come back on a prefix hit instead of being computed again (docs/design.md, "KV-cache tiers").

- `index.py`: which keys the host slots and the disk files hold, LRU order, pins (no torch);
- `manager.py`: `KVTiers`, the bookkeeping on the engine thread: saves, claims, loads, the step's
  plan of copies, stats, `check_integrity` (no torch);
- `disk.py`: the files (fingerprint, checksum) and the thread that reads and writes them (no torch);
- `fingerprint.py`: what a file must have been written for (no torch);
- `copier.py`: the host pool and the copies (the model runner's; torch, a CUDA stream on a GPU);
- `attach.py`: building all of it for an engine.
"""
