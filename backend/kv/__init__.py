"""kv: the paged KV cache's bookkeeping, on the host. No torch.

Owns the block pool every KV-cache group draws from (`block_pool.py`), the block manager of a
group (`block_manager.py`) and its prefix cache (`prefix_cache.py`), the layers' layout into groups
(`groups.py`: sliding windows), the one sizing module (`sizing.py`: the KV cache, a draft's share,
the block tables of `max_num_seqs`, and the checks against the memory there is), KV-cache events
and their publisher (`events.py`, `event_publisher.py`), and the host and disk tiers' bookkeeping
(`tiers/`). The bytes themselves live on the device, in the worker.

May import core only.
"""
