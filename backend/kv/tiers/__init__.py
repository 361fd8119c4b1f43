"""KV-cache tiers' bookkeeping: cached prefix blocks that leave the KV cache go to host memory and to
disk, and come back on a prefix hit instead of being computed again (docs/design.md, "KV-cache
tiers"). No torch here: the bytes move in the worker (worker/kv_copier.py), the engine builds it
all (engine/kv_tiers.py).

- `index.py`: which keys the host slots and the disk files hold, LRU order, pins;
- `manager.py`: `KVTiers`, the bookkeeping on the engine thread: saves, claims, loads, each step's
  plan of copies (carried to the worker by the step plan), stats, `check_integrity`;
- `plan.py`: a step's copies, a claim, a load in flight, the per-tier counts;
- `grouped.py`: the tiers over several KV-cache groups (a key per group, the hit they hold together);
- `disk.py`: the files (fingerprint, HMAC) and the thread that reads and writes them;
- `folder.py`: the disk tier's folder: its modes, its secret, its lock and the one budget of the
  engines sharing it;
- `fingerprint.py`: what a file must have been written for.
"""
