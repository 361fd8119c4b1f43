"""Completions' `echo` with `logprobs`, as vLLM answers it: the prompt's tokens lead the choice's
`logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), the first with a null
logprob and null top logprobs (nothing comes before it), the others from the engine's
prompt_logprobs (which the request asks for, at the same k, when echo and logprobs come together).
"""
from __future__ import annotations

import json
from typing import Callable, Optional, Sequence, Union

from openai_server.responses import TokenLogprob, parse_logprobs
from openai_server.translate import APIError

Prompt = Union[str, list[int]]


def prompt_ids(prompt: Prompt, tokenizer) -> list[int]:
    """The prompt's token ids as the engine makes them (a text prompt: the same tokenizer, its
    special tokens added, as backend/engine/llm_engine.py encodes it)."""
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise APIError(400, "echo with logprobs needs the tokenizer: start the server with --model-path", "echo")
    return tokenizer.encode(prompt)


def echo_logprobs(ids: Sequence[int], prompt_logprobs: Optional[list], top_k: int,
                  decode: Callable[[int], str]) -> list[TokenLogprob]:
    """The prompt's tokens as TokenLogprobs: the first with logprob None and no top, then each
    from its prompt_logprobs entry (vLLM's shape: null, then {token id: {logprob, rank,
    decoded_token}} per prompt token). A truncated prompt (truncate_prompt_tokens): its last tokens."""
    if not prompt_logprobs:
        return []
    ids = list(ids)[-len(prompt_logprobs):]
    if len(ids) != len(prompt_logprobs):
        raise APIError(500, f"echo: {len(prompt_logprobs)} prompt logprobs for a prompt of {len(ids)} tokens")
    first = TokenLogprob(ids[0], None, decode(ids[0]), None)
    return [first] + parse_logprobs(json.dumps(prompt_logprobs[1:]), ids[1:], top_k)
