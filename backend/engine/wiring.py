"""Building an engine core's parts, each given what it uses when it is made (nothing is attached to
another object afterwards): the worker first (it sizes the KV cache), then the KV tiers over its
copier, the KV-cache groups with their listeners (the tiers, the KV-event collector), the
scheduler with the tiers, the speculator, the adapters by name, the queue reports and the
structured-output compiler."""
from __future__ import annotations

from backend.core.config import EngineConfig
from backend.engine.kv_tiers import make_kv_tiers
from backend.engine.loras import EngineLoRAs
from backend.engine.queue_report import QueueReporter
from backend.engine.structured.compiler import ConstraintCompiler
from backend.kv.event_publisher import make_publisher
from backend.kv.groups import KVCacheGroups
from backend.models.loader import ModelConfig
from backend.sched.beams import BeamGroups
from backend.sched.drain import DrainEstimator, Limits
from backend.sched.factory import make_scheduler
from backend.sched.grammar_waitlist import GrammarWaitlist
from backend.speculative.speculator import Speculator
from backend.worker.runner import ModelRunner


def build_core(core, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tokenizer,
               eos_token_ids: tuple[int, ...]) -> None:
    """Give `core` (an EngineCore) its parts."""
    core.config = config
    core.runner = ModelRunner(config, model_config, max_model_len)
    try:
        core.kv_tiers = make_kv_tiers(config, core.runner)  # backend/engine/kv_tiers.py (NoKVTiers when off)
        core.kv_events = make_publisher(config.kv_events, config.kv_block_size, core.runner.num_blocks,
                                        core.runner.device, lambda salt: core.loras.name_of_salt(salt))
        drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        listeners = [x for x in (core.kv_tiers.listener, core.kv_events.listener) if x is not None]
        core.blocks = KVCacheGroups(core.runner.num_blocks, config.kv_block_size, core.runner.kv_layout.group_windows,
                                    enable_prefix_caching=config.enable_kv_cache_reuse,
                                    max_prefill_tokens=config.max_num_batched_tokens, max_decode_tokens=1 + drafts,
                                    listeners=listeners)
        core.kv_tiers.follow(core.blocks)  # a model of several KV-cache groups: every group's blocks
        core.kv_events.started(core.blocks)
        core.scheduler = make_scheduler(config, core.blocks, max_model_len, tiers=core.kv_tiers.listener)
        # speculative decoding (backend/speculative/): None when speculative_config is empty
        core.speculator = Speculator.create(config, core.scheduler, model_config.vocab_size, max_model_len,
                                            core.runner.num_blocks * config.kv_block_size)
        core.loras = EngineLoRAs(core.runner.lora, core.scheduler)  # adapters by name (docs/lora.md)
        # the queue's expected drain time (backend/sched/drain.py): overload told at arrival, queue reports
        core.drain = DrainEstimator(Limits(config.max_num_seqs, config.max_num_batched_tokens, core.blocks.num_blocks),
                                    config.batch_scheduler_policy == "guaranteed_no_evict", core.blocks.blocks_for)
        core.queue = QueueReporter(core.scheduler, core.drain)  # where requests that asked stand
        core.grammars = ConstraintCompiler(tokenizer, model_config.vocab_size, eos_token_ids,
                                           timeout=config.structured_outputs_compile_timeout_s)
        core.waitlist = GrammarWaitlist()  # requests whose constraint compiles (off the request path)
        # beam search (backend/sched/beams.py): each beam request's search, over the scheduler's sequences
        core.beams = BeamGroups(core.blocks, core.scheduler.worker_view, core.scheduler.finish)
    except BaseException:
        core.runner.close()
        raise
    core.idle = True  # the last step ran nothing (a batching gate is holding requests back)
    core.expert_tally = {}  # a mixture of experts' tokens per expert, as the worker's last step said
    core.prompt_tokens_total = 0
