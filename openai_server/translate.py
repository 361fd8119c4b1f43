"""OpenAI request bodies -> what goes to Triton: the prompt(s), the engine's sampling settings, and
the input tensors of each Triton request. No I/O here: unit-tested without a server.

Every sampling value is checked by the engine's own `SamplingParams.from_dict` (the one validation
path); its message names the engine's field, which `APIError` turns back into the OpenAI parameter
the client sent. Fields of OpenAI's API that the engine cannot honour are refused by name, never
dropped without a word.
"""
from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from backend.core import defaults
from backend.core.sampling_params import SamplingParams
from openai_server.constraints import FIELDS as STRUCTURED_FIELDS, FieldError, structured_outputs
from openai_server.tools import ToolCalling, check_tool_messages, prepare_messages

# A chat request that gives no max_tokens / max_completion_tokens gets this many (OpenAI: until the
# model stops). Bounded, because guaranteed_no_evict reserves KV blocks for all of them up front.
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = defaults.MAX_TOKENS  # as OpenAI's legacy completions endpoint
MAX_CHOICES = 64  # prompts x n of one call

Prompt = Union[str, list[int]]

# OpenAI fields the engine cannot honour: refused with a 400 that names them (unless null/default).
UNSUPPORTED = {"suffix": None,
               "functions": None, "function_call": "none", "audio": None, "modalities": None, "prediction": None,
               "web_search_options": None}
# Accepted and without effect on generation (bookkeeping fields of OpenAI's API).
IGNORED = ("user", "metadata", "store", "service_tier", "reasoning_effort")
# vLLM's OpenAI server accepts these engine settings beside OpenAI's own; so do we (AIPerf sends
# ignore_eos for fixed output lengths).
ENGINE_EXTRAS = ("top_k", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids", "min_p",
                 "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "bad_words",
                 "use_beam_search", "best_of", "length_penalty", "early_stopping")  # beam search: docs/beam_search.md
# Our own extensions, off by default: where the request stands (return_queue_info, docs/triton.md);
# a time-to-first-token target, refused at arrival with 429 when the queue cannot meet it.
EXTENSIONS = ("return_queue_info", "ttft_target_ms")
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
          "presence_penalty", "frequency_penalty", "logprobs", "logit_bias") + ENGINE_EXTRAS + EXTENSIONS + IGNORED + STRUCTURED_FIELDS
COMPLETION_FIELDS = COMMON + ("prompt", "echo")
CHAT_FIELDS = COMMON + ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls")
# engine field (as SamplingParams' messages name it) -> the OpenAI parameter, where they differ
_PARAM_OF_FIELD = {"stop_words": "stop"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message if message.startswith(param) else f"{param}: {message}", param)


@dataclass
class Generation:
    """One OpenAI call, translated: one Triton request per prompt, each asking the engine for `n`
    completions (their prompt KV computed once); choice index = prompt index * n + completion."""
    prompts: list[Prompt]
    sampling: dict[str, Any]  # the engine's sampling_parameters (only what the client set, and n)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # None: none; k: the sampled token's and the top k
    echo: bool = False
    chat: bool = False
    queue_info: bool = False  # return_queue_info: each choice carries `queue_info`
    tools: Optional[ToolCalling] = None  # tool calling: how answers are parsed (tools.py)
    images: list = field(default_factory=list)  # a chat's image files (media.py), sent as the `image` input
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def _check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for name, default in UNSUPPORTED.items():
        if body.get(name, default) not in (default, None):
            raise bad(name, f"{name} is not supported by this server")
    unknown = sorted(k for k in body if k not in allowed and k not in UNSUPPORTED)
    if unknown:
        raise bad(unknown[0], f"{unknown[0]}: unknown parameter; this endpoint accepts "
                              f"{', '.join(sorted(allowed))}")


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(name, f"{name} must be {what}; got {json.dumps(value)[:80]}")
    return value


def _sampling(body: dict[str, Any], max_tokens_names: tuple[str, ...], default_max_tokens: int,
              logprobs: Optional[int], logprobs_param: str = "logprobs") -> tuple[dict[str, Any], int]:
    """The engine's settings and n, checked by SamplingParams (errors name the OpenAI parameter)."""
    number, integer = (int, float), (int,)
    sampling: dict[str, Any] = {}
    max_tokens, max_param = None, max_tokens_names[-1]
    for name in max_tokens_names:  # max_completion_tokens wins over the deprecated max_tokens
        value = _typed(body, name, integer, "an integer")
        if value is not None:
            max_tokens, max_param = value, name
            break
    sampling["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    for name, kinds, what in (("temperature", number, "a number"), ("top_p", number, "a number"),
                              ("seed", integer, "an integer"), ("presence_penalty", number, "a number"),
                              ("frequency_penalty", number, "a number"), ("top_k", integer, "an integer"),
                              ("min_tokens", integer, "an integer"), ("ignore_eos", (bool,), "a boolean"),
                              ("repetition_penalty", number, "a number"), ("min_p", number, "a number"),
                              ("include_stop_str_in_output", (bool,), "a boolean"),
                              ("skip_special_tokens", (bool,), "a boolean"),
                              ("spaces_between_special_tokens", (bool,), "a boolean"),
                              ("truncate_prompt_tokens", integer, "an integer"),
                              ("ttft_target_ms", number, "a number (milliseconds)"),
                              ("prompt_logprobs", integer, "an integer (the number of top logprobs)"),
                              ("logit_bias", (dict,), "an object mapping token ids to biases"),
                              ("use_beam_search", (bool,), "a boolean"), ("best_of", integer, "an integer"),
                              ("length_penalty", number, "a number")):
        value = _typed(body, name, kinds, what)
        if value is not None:
            sampling[name] = value
    stopping = body.get("early_stopping")
    if stopping is not None:
        if stopping not in (True, False, "never") or isinstance(stopping, (int, float)) and not isinstance(stopping, bool):
            raise bad("early_stopping", f"early_stopping must be true, false or \"never\"; got {stopping!r}")
        sampling["early_stopping"] = stopping
    for name in ("stop", "bad_words"):  # (vLLM's bad_words: words never generated)
        words = body.get(name)
        if words is not None:
            if isinstance(words, str):
                words = [words]
            if not isinstance(words, list) or not all(isinstance(s, str) for s in words):
                raise bad(name, f"{name} must be a string or a list of strings")
            if words:
                sampling[name] = words
    bias = sampling.get("logit_bias")
    if bias is not None and not all(isinstance(k, str) and k.strip().isdigit() and isinstance(v, (int, float))
                                    and not isinstance(v, bool) for k, v in bias.items()):
        raise bad("logit_bias", "logit_bias maps token ids (as strings, e.g. \"50256\") to numbers in [-100, 100]")
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = body.get(name)
        if ids is not None:
            if not isinstance(ids, list) or not all(_is_token(t) for t in ids):
                raise bad(name, f"{name} must be a list of integers")
            sampling[name] = ids
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    n = _typed(body, "n", integer, "an integer")
    n = 1 if n is None else n
    if n != 1:
        sampling["n"] = n
        if logprobs is not None:  # the model names the sampled tokens (output_ids) only for n = 1
            raise bad(logprobs_param, f"{logprobs_param} with n > 1 is not supported; ask for n = 1")
    try:
        SamplingParams.from_dict({**sampling, "n": n})
    except ValueError as exc:  # "<field> must be ...": the engine's field -> the client's parameter
        message = str(exc)
        engine_field = message.split(" ", 1)[0].rstrip(":")
        param = {**_PARAM_OF_FIELD, "max_tokens": max_param, "logprobs": logprobs_param}.get(engine_field, engine_field)
        if param != engine_field:
            message = message.replace(engine_field, param, 1)
        raise APIError(400, message, param) from None
    return sampling, n


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", "stream_options accepts {\"include_usage\": bool}")
    return bool(options.get("include_usage", False))


def parse_completion(body: dict[str, Any]) -> Generation:
    """/v1/completions: `prompt` is a string, a list of strings, a list of token ids, or a list of
    such lists; `logprobs` is an integer (the top k besides the sampled token)."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt)):
        prompts: list[Prompt] = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_token(t) for t in p)) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt", "prompt must be a non-empty string, a list of token ids, or a list of those")
    if any(p == "" for p in prompts):
        raise bad("prompt", "prompt must not be empty")
    for p in prompts:
        _check_token_ids(p)
    logprobs = _typed(body, "logprobs", (int,), "an integer (the number of top logprobs)")
    echo = bool(_typed(body, "echo", (bool,), "a boolean"))
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    sampling, n = _sampling(body, ("max_tokens",), DEFAULT_COMPLETION_MAX_TOKENS, logprobs)
    if echo and logprobs is not None:  # vLLM: the prompt's logprobs lead the choice's (echo_logprobs.py)
        sampling.setdefault("prompt_logprobs", logprobs)
    _constrain(body, sampling, None)
    gen = Generation(prompts=prompts, sampling=sampling, n=n, stream=stream,
                     include_usage=_stream_options(body, stream), logprobs=logprobs, echo=echo,
                     queue_info=bool(_typed(body, "return_queue_info", (bool,), "a boolean")))
    _check_choices(gen)
    return gen


def parse_chat(body: dict[str, Any], render: Callable[..., str], tool_call_parser: str = "hermes") -> Generation:
    """/v1/chat/completions: `messages` rendered into one prompt by the checkpoint's chat template
    (`render`, with the tools as its variable); `logprobs` is a boolean and `top_logprobs` the k;
    tool calls are in `tool_call_parser`'s format (tools.py)."""
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    messages = list(messages)  # text parts are joined below; the caller's body stays as sent
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad("messages", f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI's content parts: only text ones can be rendered
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad("messages", f"messages[{i}].content: only text parts are supported")
            message = {**message, "content": "".join(p["text"] for p in content)}
            messages[i] = message
        elif content is None and message["role"] == "assistant" and message.get("tool_calls"):
            messages[i] = {**message, "content": ""}  # OpenAI's shape of a turn that only called tools
        elif not isinstance(content, str):  # null otherwise: a template would fail on it (a 500)
            raise bad("messages", f"messages[{i}].content must be a string or a list of text parts; "
                                  f"got {json.dumps(content)[:40]}")
    want = _typed(body, "logprobs", (bool,), "a boolean")
    top = _typed(body, "top_logprobs", (int,), "an integer")
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if want else None
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    sampling, n = _sampling(body, ("max_completion_tokens", "max_tokens"), DEFAULT_CHAT_MAX_TOKENS, logprobs,
                             "top_logprobs")
    try:
        tools = ToolCalling.from_body(body, tool_call_parser)
        check_tool_messages(messages)
    except FieldError as exc:
        raise bad(exc.param, str(exc)) from None
    _constrain(body, sampling, tools)
    prompt = render(prepare_messages(messages), tools=tools.template_tools(), tools_fallback=tools.tools_in_system_message) \
        if tools else render(messages)
    gen = Generation(prompts=[prompt], sampling=sampling, n=n, stream=stream,
                     include_usage=_stream_options(body, stream), logprobs=logprobs, chat=True, tools=tools,
                     queue_info=bool(_typed(body, "return_queue_info", (bool,), "a boolean")))
    _check_choices(gen)
    return gen


def _constrain(body: dict[str, Any], sampling: dict[str, Any], tools: Optional[ToolCalling]) -> None:
    """response_format, vLLM's structured_outputs / guided_* and enforced tool calls -> the
    engine's structured_outputs (constraints.py)."""
    try:
        spec = structured_outputs(body, tools)
    except FieldError as exc:
        raise bad(exc.param, str(exc)) from None
    if spec is not None:
        sampling["structured_outputs"] = spec


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_TOKEN_ID = 2**31 - 1  # input_ids is an INT32 tensor: numpy would wrap a larger id silently


def _check_token_ids(prompt: Prompt) -> None:
    """A token id the INT32 input cannot carry is refused here, naming it; one that fits but is
    past the vocabulary is refused by the engine, naming it too (a 400 either way)."""
    if isinstance(prompt, str):
        return
    bad_id = next((t for t in prompt if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad_id is not None:
        raise bad("prompt", f"prompt: token id {bad_id} is outside the vocabulary (token ids are in "
                            f"[0, vocabulary size), at most {MAX_TOKEN_ID})")


def _check_choices(gen: Generation) -> None:
    if gen.num_choices > MAX_CHOICES:
        raise bad("n", f"n x prompts must be at most {MAX_CHOICES}; got {gen.num_choices}")


# -- Triton input tensors ----------------------------------------------------------------------------

# The model's optional outputs (the vLLM backend's additional outputs) that a response needs.
RETURN_INPUTS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                 "return_num_cached_tokens")


def triton_tensors(gen: Generation, index: int, declared: frozenset[str]) -> dict[str, tuple[np.ndarray, str]]:
    """The input tensors of the request for prompt `index`: name -> (array, Triton datatype).
    `declared` are the model's input names: the `return_*` switches are sent where it has them."""
    prompt = gen.prompts[index]
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    if isinstance(prompt, str):
        tensors["text_input"] = (np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")
    else:
        tensors["input_ids"] = (np.array(prompt, dtype=np.int32), "INT32")
    if gen.images:  # (docs/vision.md) base64, as the vLLM backend's `image` input
        if "image" not in declared:
            raise APIError(400, "messages: the served model has no image input", "messages")
        tensors["image"] = (np.array([base64.b64encode(b) for b in gen.images], dtype=np.object_), "BYTES")
    tensors["stream"] = (np.array([gen.stream]), "BOOL")
    tensors["exclude_input_in_output"] = (np.array([True]), "BOOL")
    sampling = json.dumps(gen.sampling).encode("utf-8")
    tensors["sampling_parameters"] = (np.array([sampling], dtype=np.object_), "BYTES")
    wanted = RETURN_INPUTS + (("return_logprobs",) if gen.logprobs is not None else ()) \
        + (("return_prompt_logprobs",) if gen.sampling.get("prompt_logprobs") is not None else ()) \
        + (("return_queue_info",) if gen.queue_info else ())
    for name in wanted:
        if name in declared:
            tensors[name] = (np.array([True]), "BOOL")
    if gen.logprobs is not None and "return_logprobs" not in declared:
        raise APIError(400, "logprobs: the served model has no logprobs output (return_logprobs)",
                       "top_logprobs" if gen.chat else "logprobs")
    if gen.sampling.get("prompt_logprobs") is not None and "return_prompt_logprobs" not in declared:
        raise APIError(400, "prompt_logprobs: the served model has no prompt_logprobs output", "prompt_logprobs")
    if gen.queue_info and "return_queue_info" not in declared:
        raise APIError(400, "return_queue_info: the served model has no queue info outputs", "return_queue_info")
    return tensors
