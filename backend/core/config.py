"""EngineConfig: every engine setting, validated in one place.

Field names are a contract: they are the `parameters` keys of `config.pbtxt` (docs/design.md), named after
TensorRT-LLM's backend where it has one. `from_params` maps the strings Triton hands us into typed
fields; `validate` is the single place a bad value is refused, with the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from backend.core import defaults
from backend.core.kv_events_config import KVEventsConfig, parse_kv_events_config
from backend.core.kv_tiers_config import validate_kv_tiers
from backend.core.pooling import RUNNERS
from backend.core.multimodal import images_per_prompt
from backend.core.lora import check_adapter_name, check_name, parse_lora_modules
from backend.core.speculative_config import SpeculativeConfig, parse_speculative_config

POLICIES = ("guaranteed_no_evict", "max_utilization")
BATCHING_MODES = ("inflight", "dynamic", "static", "none")
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "fp8")  # docs/quantization.md
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3")
MAX_COMPILE_TIMEOUT_S = 600.0
MAX_INTER_TOKEN_TARGET_MS = 600_000.0
MAX_KV_BLOCK_SIZE = 1024  # tokens per block; vLLM's largest is 256 (a block is the unit of prefix reuse)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass
class EngineConfig:
    model_path: str = ""
    runner: str = defaults.RUNNER  # vLLM's --runner: auto | generate | pooling (docs/pooling.md)
    # auto: float32 on CPU; on CUDA the checkpoint's half type, float32 checkpoints in bfloat16
    # (float16 before compute capability 8.0), as vLLM (backend/worker/device.py)
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    kv_block_size: int = 16
    # Explicit KV capacity: the memory of that many tokens in every layer (a model with sliding-window
    # layers holds more tokens in it, backend/kv/groups.py); 0 sizes it from
    # kv_cache_free_gpu_mem_fraction on CUDA and from cpu_kv_cache_tokens (same meaning) on CPU.
    max_tokens_in_paged_kv_cache: int = 0
    # Share of the GPU memory free after the weights and the largest step's activations that the KV
    # cache takes; the rest is headroom (CUDA graphs, cuBLAS, fragmentation): backend/kv/sizing.py.
    kv_cache_free_gpu_mem_fraction: float = 0.9
    cpu_kv_cache_tokens: int = 65536
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the checkpoint's max_position_embeddings
    # Longest text prompt in UTF-8 bytes, checked before tokenizing. 0: derived from max_model_len and
    # the tokenizer (a text past it could never fit in max_model_len tokens); N: this many bytes.
    max_input_bytes: int = 0
    batch_scheduler_policy: str = "guaranteed_no_evict"
    enable_chunked_context: bool = True
    # Prefix caching, on by default as vLLM's and SGLang's (TRT-LLM's default is off): a no-reuse
    # workload runs as fast with it (docs/performance.md, "Prefix reuse by default").
    enable_kv_cache_reuse: bool = True
    # guaranteed_no_evict: let later requests start ahead of one that does not fit when they cannot
    # delay it past its reservation (docs/design.md, "Scheduling"). false: strict order, as TRT-LLM.
    enable_backfill: bool = True
    batching_mode: str = "inflight"
    max_queue_size: int = 1024  # waiting requests beyond this are refused at once; 0: unbounded
    # Time-to-first-token target (ms) of a request that names none (its `ttft_target_ms` sampling
    # key wins): a request the queue cannot start within it is refused at arrival with the seconds
    # to retry after (backend/sched/drain.py; docs/configuration.md, "Overload"). 0: no target.
    ttft_target_ms: float = 0.0
    max_queue_delay_microseconds: int = 50000  # static/dynamic: longest wait for a batch to fill
    executor_static_batch_size: int = -1  # -1: off; N: static batches of N (forces batching_mode=static)
    dynamic_padding_threshold: float = 1.1  # dynamic: a batch holds lengths within this factor
    # Prefill pacing (backend/sched/pacing.py, docs/configuration.md): while requests decode, a step's
    # prompt tokens are capped so that it stays within this inter-token target, priced by the engine's
    # own online model of its step time. -1: auto, inter_token_auto_factor x the decode rows' own step
    # time; 0: off (a prompt takes up to max_num_batched_tokens a step); N > 0: N milliseconds.
    inter_token_target_ms: float = -1.0
    inter_token_auto_factor: float = 1.75
    # vLLM's scheduler_delay_factor: while requests run, new prompts wait until the oldest waiting one
    # has waited this many times the last step, so that they start together. 0: no wait.
    scheduler_delay_factor: float = 0.0
    attention_backend: str = "auto"
    # true: no CUDA graphs, every decode step launches its kernels one by one (vLLM's enforce_eager).
    # false: decode steps replay graphs captured at start-up per padded batch size (Triton kernels, CUDA).
    enforce_eager: bool = False
    seed: int = 0
    # Streaming (the server): a response carries at least this many new tokens (the first token and
    # the last response go out at once), as vLLM's --stream-interval. 1: a response per step.
    stream_interval: int = 1
    # Quantized weights and KV cache (docs/quantization.md). quantization: auto = the checkpoint's
    # (gguf for a packed `inflight import-gguf` folder, else none); none = float weights (a packed
    # folder is dequantized at load); gguf = packed weights as they are; int8 = float weights
    # quantized at load (int8, a scale per 32 values); fp8 = e4m3 weights (CUDA only).
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: dtype's | float32 | bfloat16 | fp8 = fp8_e4m3 (CUDA sm_89+)
    # Multi-LoRA (docs/lora.md), vLLM's names and defaults: PEFT adapters from the checkpoint
    # folder's multi_lora.json and `lora_modules` (JSON {name: folder} or NAME=PATH,...), at most
    # max_loras of them in one step (requests of others wait), ranks up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: str = "{}"
    # An adapter of multi_lora.json / lora_modules that fails its checks at start stops the model's
    # start (false, as vLLM); true: the model starts with the others and logs one line per bad one.
    skip_invalid_lora_adapters: bool = False
    # Adapters loaded and unloaded while the model serves (vLLM's /v1/load_lora_adapter; docs/lora.md):
    # off by default, as vLLM (its VLLM_ALLOW_RUNTIME_LORA_UPDATING). Needs enable_lora.
    enable_runtime_lora: bool = defaults.ENABLE_RUNTIME_LORA
    # The most adapters loaded at once (host memory; vLLM's max_cpu_loras): a load past it is refused,
    # at start and at run time. 0: no limit; else >= max_loras.
    max_cpu_loras: int = 0
    # The name clients give the base model (vLLM's --served-model-name; the OpenAI server's flag of that
    # name should match): no LoRA adapter may be named like it, nor `llm`.
    served_model_name: str = "llm"
    # Speculative decoding (backend/spec/): JSON with vLLM's speculative_config keys; "" is off.
    # The Python API also takes a dict. Runs where the in-flight scheduler does (inflight, none).
    speculative_config: str = ""
    # Ranks one engine runs on (tensor parallelism, docs/parallelism.md): each holds 1/N of every
    # layer's heads and MLP columns, of the vocabulary and of the KV cache; rank 0 schedules and
    # samples, ranks 1..N-1 are processes it starts (NCCL on GPU: devices cuda:i*N .. cuda:i*N+N-1
    # for instance i; gloo on CPU).
    tensor_parallel_size: int = 1
    # KV-cache events for prefix-aware routing (backend/kv/events.py, docs/gateway.md): JSON with
    # vLLM's --kv-events-config keys ("" is off); needs enable_kv_cache_reuse. The Python API takes a dict.
    kv_events_config: str = ""
    # KV-cache tiers (backend/kv/tiers/, docs/design.md "KV-cache tiers"): cached prefix blocks that
    # leave the KV cache are kept in host memory (at most kv_host_cache_bytes; 0 is off) and written
    # to files under kv_disk_cache_dir (at most kv_disk_cache_bytes; "" is off), and copied back on a
    # prefix hit instead of being computed again. Both need enable_kv_cache_reuse; the disk tier
    # stages its blocks through the host tier, so it needs kv_host_cache_bytes too (kv_tiers_config.py).
    # kv_tier_load_policy: auto loads a prefix back only where the copy costs less than computing it
    # again (backend/sched/tier_choice.py); always: every prefix found; never: recompute, tiers unread.
    kv_host_cache_bytes: int = 0
    kv_disk_cache_dir: str = ""
    kv_disk_cache_bytes: int = 0
    kv_tier_load_policy: str = "auto"
    # Structured outputs (backend/structured/): the longest a constraint new to the engine may compile
    # (in a worker process, off the request path) before it is refused with a 400 and its worker is
    # killed; also the longest it may wait for a free worker before it is refused as busy.
    structured_outputs_compile_timeout_s: float = 5.0
    # Images (docs/vision.md), vLLM's names: the most images a prompt may carry (N or {"image": N});
    # the encoder outputs kept by image hash (bytes); the image tokens a step may encode (0: as many as
    # max_num_batched_tokens; an image is never split, so one larger than this is refused at arrival).
    limit_mm_per_prompt: str = str(defaults.LIMIT_IMAGES_PER_PROMPT)
    encoder_cache_bytes: int = defaults.ENCODER_CACHE_BYTES
    max_num_encoder_input_tokens: int = 0

    @classmethod
    def from_params(cls, params: Mapping[str, str], **overrides: Any) -> "EngineConfig":
        """Build from config.pbtxt string parameters; unknown keys and bad values raise ValueError."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in params.items():
            if key not in types:
                raise ValueError(
                    f"unknown parameter '{key}'; allowed parameters: {', '.join(sorted(types))}")
            values[key] = _parse(key, str(raw).strip(), types[key])
        values.update(overrides)
        return cls(**values)

    @classmethod
    def typed_overrides(cls, params: Mapping[str, str]) -> dict[str, Any]:
        """config.pbtxt strings (a tool's `--param KEY=VALUE`s) -> those keys' typed values, checked
        as from_params checks them: keyword arguments for `LLM(model_path, **overrides)`."""
        typed = cls.from_params(params)
        return {key: getattr(typed, key) for key in params}

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, Mapping):
            self.speculative_config = json.dumps(dict(self.speculative_config))
        if isinstance(self.kv_events_config, Mapping):
            self.kv_events_config = json.dumps(dict(self.kv_events_config))
        if self.executor_static_batch_size not in (-1, 0) and self.executor_static_batch_size > 0:
            self.batching_mode = "static"
        self.validate()

    def validate(self) -> None:
        for key, allowed in (("dtype", DTYPES), ("runner", RUNNERS), ("batch_scheduler_policy", POLICIES),
                             ("batching_mode", BATCHING_MODES), ("attention_backend", ATTENTION_BACKENDS),
                             ("quantization", QUANTIZATIONS), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            _choice(key, getattr(self, key), allowed)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got '{self.device}'")
        if not 1 <= self.kv_block_size <= MAX_KV_BLOCK_SIZE:  # sizes against memory: backend/kv/sizing.py
            raise ValueError(f"kv_block_size must be in [1, {MAX_KV_BLOCK_SIZE}] tokens; got {self.kv_block_size}")
        _at_least("max_tokens_in_paged_kv_cache", self.max_tokens_in_paged_kv_cache, 0)
        _at_least("cpu_kv_cache_tokens", self.cpu_kv_cache_tokens, 1)
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction < 1.0:
            raise ValueError("kv_cache_free_gpu_mem_fraction must be in (0, 1): the rest of the free memory is "
                             "headroom for CUDA graphs, cuBLAS workspaces and fragmentation; got "
                             f"{self.kv_cache_free_gpu_mem_fraction}")
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("max_model_len", self.max_model_len, 0)
        _at_least("max_input_bytes", self.max_input_bytes, 0)
        _at_least("max_queue_size", self.max_queue_size, 0)
        if not 0.0 <= self.ttft_target_ms <= MAX_INTER_TOKEN_TARGET_MS:
            raise ValueError(f"ttft_target_ms must be in [0, {MAX_INTER_TOKEN_TARGET_MS:.0f}] (0: no target); "
                             f"got {self.ttft_target_ms}")
        _at_least("max_queue_delay_microseconds", self.max_queue_delay_microseconds, 0)
        _at_least("stream_interval", self.stream_interval, 1)
        _at_least("max_loras", self.max_loras, 1)
        _at_least("max_lora_rank", self.max_lora_rank, 1)
        check_name(self.served_model_name, "served_model_name")
        if self.enable_runtime_lora and not self.enable_lora:
            raise ValueError("enable_runtime_lora needs enable_lora=true (adapters load into LoRA slots)")
        if self.max_cpu_loras and not self.max_loras <= self.max_cpu_loras:
            raise ValueError(f"max_cpu_loras must be 0 (no limit) or >= max_loras ({self.max_loras}); "
                             f"got {self.max_cpu_loras}")
        modules = parse_lora_modules(self.lora_modules)  # its syntax too, before anything loads
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=true")
        for name in modules:
            check_adapter_name(name, "lora_modules", self.served_model_name)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        if not 0.0 < self.structured_outputs_compile_timeout_s <= MAX_COMPILE_TIMEOUT_S:
            raise ValueError(f"structured_outputs_compile_timeout_s must be in (0, {MAX_COMPILE_TIMEOUT_S:g}] seconds; "
                             f"got {self.structured_outputs_compile_timeout_s}")
        if self.executor_static_batch_size == 0 or self.executor_static_batch_size < -1:
            raise ValueError("executor_static_batch_size must be -1 (off) or >= 1; "
                             f"got {self.executor_static_batch_size}")
        if not (self.inter_token_target_ms == -1 or 0 <= self.inter_token_target_ms <= MAX_INTER_TOKEN_TARGET_MS):
            raise ValueError(f"inter_token_target_ms must be -1 (auto), 0 (off) or a target in (0, "
                             f"{MAX_INTER_TOKEN_TARGET_MS:g}] milliseconds; got {self.inter_token_target_ms}")
        if not 1.0 < self.inter_token_auto_factor <= 100.0:
            raise ValueError("inter_token_auto_factor must be in (1, 100] (the paced step over the decode rows' own "
                             f"step); got {self.inter_token_auto_factor}")
        if not 0.0 <= self.scheduler_delay_factor <= 100.0:
            raise ValueError(f"scheduler_delay_factor must be in [0, 100]; got {self.scheduler_delay_factor}")
        if self.dynamic_padding_threshold < 1.0:
            raise ValueError("dynamic_padding_threshold must be >= 1.0; "
                             f"got {self.dynamic_padding_threshold}")
        events = self.kv_events
        if events is not None and events.enable_kv_cache_events and not self.enable_kv_cache_reuse:
            raise ValueError("kv_events_config: enable_kv_cache_events needs enable_kv_cache_reuse=true (the "
                             "events tell a router what the prefix cache holds)")
        validate_kv_tiers(self)
        images_per_prompt(self.limit_mm_per_prompt)
        _at_least("encoder_cache_bytes", self.encoder_cache_bytes, 1)
        _at_least("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 0)
        if self.speculative is not None and self.batching_mode in ("static", "dynamic"):
            raise ValueError(f"speculative_config needs batching_mode inflight or none; got '{self.batching_mode}' "
                             "(padded batches run every member to the longest: nothing to speculate on)")

    @property
    def speculative(self) -> "SpeculativeConfig | None":
        """speculative_config, parsed and checked (ValueError naming the key)."""
        return parse_speculative_config(self.speculative_config)

    @property
    def kv_events(self) -> "KVEventsConfig | None":
        """kv_events_config, parsed and checked (ValueError naming the key)."""
        return parse_kv_events_config(self.kv_events_config)

    @property
    def static_batch_size(self) -> int:
        return self.executor_static_batch_size if self.executor_static_batch_size > 0 else self.max_num_seqs


def _parse(key: str, raw: str, typ: Any) -> Any:
    name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if name == "bool":
            low = raw.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if name == "int":
            return int(raw)
        if name == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"parameter '{key}' must be {_KIND[name]}; got '{raw}'") from None
    return raw


_KIND = {"bool": "true or false", "int": "an integer", "float": "a number"}


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}; got '{value}'")


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{key} must be >= {low}; got {value}")
