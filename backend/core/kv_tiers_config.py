"""The KV-cache tiers' settings, checked once for `EngineConfig.validate` (backend/core/config.py):
kv_host_cache_bytes, kv_disk_cache_dir, kv_disk_cache_bytes and kv_tier_load_policy, each refusal
one line naming the key (docs/configuration.md, "KV-cache tiers").
"""
from __future__ import annotations

# kv_tier_load_policy: auto loads a prefix found in a tier only where copying it back costs less than
# computing it again (backend/sched/tier_choice.py); always loads it; never computes it again.
KV_TIER_LOAD_POLICIES = ("auto", "always", "never")


def validate_kv_tiers(config) -> None:
    """Refuse, naming the key, tier settings that cannot work together (`config`: an EngineConfig)."""
    c = config
    if c.kv_tier_load_policy not in KV_TIER_LOAD_POLICIES:
        raise ValueError(f"kv_tier_load_policy must be one of {', '.join(KV_TIER_LOAD_POLICIES)}; "
                         f"got '{c.kv_tier_load_policy}'")
    for key in ("kv_host_cache_bytes", "kv_disk_cache_bytes"):
        if getattr(c, key) < 0:
            raise ValueError(f"{key} must be >= 0; got {getattr(c, key)}")
    disk = bool(c.kv_disk_cache_dir.strip())
    if disk and c.kv_disk_cache_bytes == 0:
        raise ValueError("kv_disk_cache_dir needs kv_disk_cache_bytes > 0 (the disk tier's size in bytes)")
    if c.kv_disk_cache_bytes and not disk:
        raise ValueError("kv_disk_cache_bytes needs kv_disk_cache_dir (the folder of the disk tier)")
    if not (c.kv_host_cache_bytes or disk):
        return
    key = "kv_host_cache_bytes" if c.kv_host_cache_bytes else "kv_disk_cache_dir"
    if disk and not c.kv_host_cache_bytes:
        raise ValueError("kv_disk_cache_dir needs kv_host_cache_bytes > 0: blocks reach the disk and come back "
                         "through the host tier")
    if not c.enable_kv_cache_reuse:
        raise ValueError(f"{key} needs enable_kv_cache_reuse=true (the tiers keep cached prefix blocks)")
    if c.batching_mode in ("static", "dynamic"):
        raise ValueError(f"{key} needs batching_mode inflight or none; got '{c.batching_mode}' (padded "
                         "batches start whole and cannot wait for a prefix to come back)")
    if c.tensor_parallel_size > 1:
        raise ValueError(f"{key} is not supported with tensor_parallel_size > 1 yet (every rank would have to "
                         "copy its own shard in the same steps)")
