"""`make_scheduler`: the scheduler for a config, kept apart from the classes it chooses among."""
from __future__ import annotations

from backend.kv.groups import KVCacheGroups
from backend.core.config import EngineConfig
from backend.sched.batching import make_gate
from backend.sched.padded import PaddedScheduler
from backend.sched.policies import make_policy
from backend.sched.scheduler import Scheduler


def make_scheduler(config: EngineConfig, blocks: KVCacheGroups, max_model_len: int, tiers=None) -> Scheduler:
    """The in-flight scheduler, or the padded request-level batches (static, dynamic). `tiers`: the
    KV tiers when they are on (padded batches refuse them: backend/engine/kv_tiers.py)."""
    gate = make_gate(config)
    if gate.pads:
        return PaddedScheduler(config, blocks, max_model_len, gate, make_policy(config.batch_scheduler_policy, blocks))
    return Scheduler(config, blocks, max_model_len, gate, tiers=tiers)
