"""The `llm` model's tensors: one table that the config template is rendered from
(`render.py`), that the adapter reads requests with (`model_repository/llm/1/`), and that the
client library builds requests from (`client/protocol.py`). Plain data: no numpy, no Triton.

Names and types are those of Triton's vLLM backend and of the TensorRT-LLM ensemble, so their
clients (the vLLM backend's samples, Triton's OpenAI frontend, genai-perf) work unchanged.
The defaults a doc names come from backend/core/defaults.py (which imports nothing).
`key` is the vLLM `sampling_parameters` key an input sets (an explicit input tensor wins over the
JSON and over request parameters); `None` for inputs that are not sampling settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from backend.core import defaults


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # Triton's name: STRING (BYTES on the wire), INT32, UINT32, INT64, UINT64, FP32, BOOL
    dims: tuple[int, ...]
    doc: str
    key: Optional[str] = None  # the sampling key it sets


INPUTS: tuple[Tensor, ...] = (
    # -- the prompt and the request's form --
    Tensor("text_input", "STRING", (1,), "the prompt (or input_ids)"),
    Tensor("input_ids", "INT32", (-1,), "the prompt as token ids"),
    Tensor("image", "STRING", (-1,),
           "images as base64 strings (PNG, JPEG, WebP), the vLLM backend's input: one per begin-of-image "
           "marker of the prompt (Gemma 3: <start_of_image>), at most limit_mm_per_prompt; a vision-language "
           "model only (docs/vision.md)"),
    Tensor("stream", "BOOL", (1,), "default false: one response at the end; true: one per step"),
    Tensor("exclude_input_in_output", "BOOL", (1,),
           "default: false without streaming (the prompt leads text_output); streaming refuses false"),
    Tensor("sampling_parameters", "STRING", (1,),
           "the vLLM backend's JSON of sampling settings; else the request parameters are read"),
    Tensor("stop", "BOOL", (1,), "true: cancel the running request with this request id"),
    Tensor("priority", "INT32", (1,), "default 0; lower runs first"),
    # -- which outputs to return (the vLLM backend's additional outputs) --
    Tensor("return_finish_reason", "BOOL", (1,), "add finish_reason"),
    Tensor("return_cumulative_logprob", "BOOL", (1,), "add cumulative_logprob"),
    Tensor("return_logprobs", "BOOL", (1,), "add logprobs (needs the sampling key logprobs)"),
    Tensor("return_num_input_tokens", "BOOL", (1,), "add num_input_tokens"),
    Tensor("return_num_output_tokens", "BOOL", (1,), "add num_output_tokens"),
    Tensor("return_num_cached_tokens", "BOOL", (1,), "add num_cached_tokens"),
    Tensor("return_prompt_logprobs", "BOOL", (1,), "add prompt_logprobs (needs the sampling key prompt_logprobs)"),
    Tensor("reasoning_parser", "STRING", (1,),
           "qwen3 | deepseek_r1 (vLLM's names): the thinking goes to reasoning_output, text_output keeps the "
           "answer; default: none"),
    Tensor("return_queue_info", "BOOL", (1,),
           "add where it stands (queue_position ... expected_wait_seconds); streaming, also a response "
           "(no tokens) whenever its place or reservation changes while it waits"),
    # -- pooling (docs/pooling.md): a model served by the pooling runner answers with `embedding` --
    Tensor("pooling_task", "STRING", (1,), "embed | classify: what the request expects of a pooling model "
           "(refused by a generate model, or by a pooling model that does the other)"),
    Tensor("dimensions", "INT32", (1,), "pooling: an embedding's first n values, normalized (Matryoshka models only)"),
    # -- sampling settings --
    Tensor("max_tokens", "INT32", (1,), f"default {defaults.MAX_TOKENS}; >= 1", "max_tokens"),
    Tensor("temperature", "FP32", (1,), "default 1.0; >= 0, below 1e-5 is greedy", "temperature"),
    Tensor("top_k", "INT32", (1,), "default 0; -1 or 0: off (vLLM's -1); else >= 1", "top_k"),
    Tensor("top_p", "FP32", (1,), "default 1.0; (0, 1]", "top_p"),
    Tensor("seed", "UINT64", (1,), "default: unseeded; [0, 2^63)", "seed"),
    Tensor("stop_words", "STRING", (-1,), "stop strings (not part of the output)", "stop"),
    Tensor("bad_words", "STRING", (-1,), "words never generated", "bad_words"),
    Tensor("ignore_eos", "BOOL", (1,), "default false", "ignore_eos"),
    Tensor("min_tokens", "INT32", (1,), "default 0; [0, max_tokens]", "min_tokens"),
    Tensor("repetition_penalty", "FP32", (1,), "default 1.0 (off); > 0", "repetition_penalty"),
    Tensor("presence_penalty", "FP32", (1,), "default 0.0; [-2, 2]", "presence_penalty"),
    Tensor("frequency_penalty", "FP32", (1,), "default 0.0; [-2, 2]", "frequency_penalty"),
    # -- the TensorRT-LLM ensemble's names for the same settings --
    Tensor("random_seed", "UINT64", (1,), "TensorRT-LLM name of seed", "seed"),
    Tensor("runtime_top_k", "INT32", (1,), "TensorRT-LLM name of top_k", "top_k"),
    Tensor("runtime_top_p", "FP32", (1,), "TensorRT-LLM name of top_p", "top_p"),
    Tensor("min_length", "INT32", (1,), "TensorRT-LLM name of min_tokens", "min_tokens"),
    Tensor("num_return_sequences", "INT32", (1,), "TensorRT-LLM name of n", "n"),
    Tensor("end_id", "INT32", (1,), "TensorRT-LLM: the token that ends generation instead of EOS"),
    Tensor("pad_id", "INT32", (1,), "TensorRT-LLM: accepted, no effect (outputs are never padded)"),
    Tensor("beam_width", "INT32", (1,), "TensorRT-LLM: default 1; > 1 runs beam search, every beam returned best "
           "first (num_return_sequences: fewer); temperature 0 unless sent"),
    Tensor("len_penalty", "FP32", (1,), "TensorRT-LLM: beam search's length penalty (default 1.0)", "length_penalty"),
    Tensor("length_penalty", "FP32", (1,), "TensorRT-LLM: beam search's length penalty (default 1.0)", "length_penalty"),
    Tensor("early_stopping", "BOOL", (1,), "TensorRT-LLM: beam search ends once beam_width beams finished "
           "(default false)", "early_stopping"),
    Tensor("return_log_probs", "BOOL", (1,), "TensorRT-LLM: add cum_log_probs and output_log_probs (each "
           "generated token's logprob; beam search: per beam)"),
    Tensor("embedding_bias_words", "STRING", (-1,),
           "TensorRT-LLM: words whose tokens get the weight of the same index (logit_bias)"),
    Tensor("embedding_bias_weights", "FP32", (-1,), "TensorRT-LLM: one bias per embedding_bias_words entry"),
)

OUTPUTS: tuple[Tensor, ...] = (
    Tensor("text_output", "STRING", (-1,),
           "one per completion: streaming, the new text; else all of it (prompt first unless excluded)"),
    Tensor("output_ids", "INT32", (-1,), "n = 1: the token ids, as text_output; beam search: [beams, tokens], "
           "best first, each padded with -1 to the longest"),
    Tensor("finish_reason", "STRING", (-1,), "if asked; one per completion: None while running, stop | length | abort"),
    Tensor("cumulative_logprob", "FP32", (-1,),
           "if asked; one per completion; NaN unless the sampling key logprobs is set"),
    Tensor("logprobs", "STRING", (-1,), "if asked; one JSON per completion, the new tokens' (null if not set)"),
    Tensor("num_input_tokens", "UINT32", (1,), "if asked; the prompt's tokens"),
    Tensor("num_output_tokens", "UINT32", (-1,), "if asked; one per completion: the tokens in this response"),
    Tensor("num_cached_tokens", "UINT32", (1,),
           "if asked; prompt tokens whose KV came from the prefix cache or a KV tier, not computed (vLLM's "
           "num_cached_tokens; 0 until the request starts)"),
    # -- return_queue_info (docs/triton.md, "Queue info"); the first completion's with n > 1 --
    Tensor("queue_position", "INT32", (1,), "if asked; its place among the waiting (0: next to start); -1 once it runs"),
    Tensor("reserved_step", "INT64", (1,),
           "if asked; guaranteed_no_evict with backfill, the waiting head only: it starts by this engine step; -1: none"),
    Tensor("engine_step", "INT64", (1,), "if asked; the engine step this response reflects (reserved_step's clock)"),
    Tensor("first_scheduled_step", "INT64", (1,), "if asked; the engine step it first ran; -1 until then"),
    Tensor("kv_blocks_reserved", "UINT32", (1,),
           "if asked; KV blocks reserved for it once it runs (to completion under guaranteed_no_evict); 0 while waiting"),
    Tensor("arrival_time_ns", "INT64", (1,), "if asked; Unix time in ns it arrived (TensorRT-LLM's name)"),
    Tensor("first_scheduled_time_ns", "INT64", (1,), "if asked; Unix time in ns it first ran; 0 until then"),
    Tensor("first_token_time_ns", "INT64", (1,), "if asked; Unix time in ns of its first token; 0 until then"),
    Tensor("finished_time_ns", "INT64", (1,), "if asked; Unix time in ns it finished; 0 until then"),
    Tensor("seconds_since_arrival", "FP64", (1,), "if asked; seconds from its arrival to this response"),
    Tensor("expected_wait_seconds", "FP64", (1,),
           "if asked; while it waits, the engine's expected seconds until it starts (-1: not known yet); 0 once it runs"),
    Tensor("prompt_logprobs", "STRING", (1,),
           "if asked; vLLM's prompt_logprobs as JSON: null for the first prompt token, then per token {id: "
           "{logprob, rank, decoded_token}}; with the first tokens (null in later streamed responses)"),
    Tensor("reasoning_output", "STRING", (-1,),
           "with reasoning_parser; one per completion: the thinking (streaming, its new piece; a partial tag "
           "held back until it is known)"),
    Tensor("cum_log_probs", "FP32", (-1,), "TensorRT-LLM, with return_log_probs; one per completion (beam, best "
           "first): the sum of its generated tokens' logprobs so far"),
    Tensor("output_log_probs", "FP32", (-1, -1), "TensorRT-LLM, with return_log_probs; [completions, tokens]: each "
           "generated token's logprob (streaming, the new tokens'), the shorter rows padded with 0"),
    Tensor("embedding", "FP32", (-1,), "pooling runner: the embedding (normalized as the model says), or a "
           "classifier's scores (one label: its sigmoid)"),
)

RETURN_FLAGS = tuple(t.name for t in INPUTS if t.name.startswith("return_"))
# What return_queue_info adds, each [1] (the request's first completion).
QUEUE_INFO_OUTPUTS = ("queue_position", "reserved_step", "engine_step", "first_scheduled_step", "kv_blocks_reserved",
                      "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "finished_time_ns",
                      "seconds_since_arrival", "expected_wait_seconds")

_BY_NAME = {t.name: t for t in INPUTS + OUTPUTS}
assert set(QUEUE_INFO_OUTPUTS) <= {t.name for t in OUTPUTS}


def tensor(name: str) -> Tensor:
    return _BY_NAME[name]


def pbtxt(tensors: tuple[Tensor, ...], optional: bool) -> str:
    """The config.pbtxt `input [...]` / `output [...]` entries, one a line with its doc."""
    lines = []
    for i, t in enumerate(tensors):
        dims = ", ".join(str(d) for d in t.dims)
        entry = f'  {{ name: "{t.name}" data_type: TYPE_{t.data_type} dims: [ {dims} ]'
        entry += " optional: true }" if optional else " }"
        comma = "," if i < len(tensors) - 1 else ""
        lines.append(f"{entry}{comma}  # {t.doc}")
    return "\n".join(lines)
