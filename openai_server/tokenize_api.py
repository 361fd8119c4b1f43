"""vLLM's /tokenize and /detokenize, by the served checkpoint's tokenizer.

    POST /tokenize   {"model", "prompt", "add_special_tokens": true, "return_token_strs": false}
                  or {"model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt": true}
                  -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize {"model", "tokens"} -> {"prompt"}

A chat is rendered exactly as /v1/chat/completions renders it (reasoning_request.parse_chat_request:
the template, its tools and variables), so `count` is the prompt the chat would send. `model` may be
left out, as vLLM allows. Both run on the server's pool (a long prompt is tokenized off the event
loop)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from openai_server.translate import APIError, bad

TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
                   "chat_template_kwargs", "return_token_strs")
CHAT_KEYS = ("model", "messages", "tools", "chat_template_kwargs")  # what the chat path reads of them


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be a boolean")
    return value


def _tokenizer(render: Any) -> Any:
    if render.tokenizer is None:
        raise APIError(400, "/tokenize and /detokenize need the model's tokenizer: start the server with "
                            "--model-path (inflight serve passes it)")
    return render.tokenizer


def tokenize(body: dict[str, Any], render: Any, tool_call_parser: str, reasoning_parser: Optional[str],
             max_model_len: Optional[int]) -> dict[str, Any]:
    from openai_server.reasoning_request import parse_chat_request

    unknown = sorted(set(body) - set(TOKENIZE_FIELDS))
    if unknown:
        raise bad(unknown[0], f"{unknown[0]} is not a /tokenize field (vLLM's: {', '.join(TOKENIZE_FIELDS)})")
    tokenizer = _tokenizer(render)
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "prompt: give a prompt (a string) or messages (a chat), one of them")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad("prompt", "prompt must be a string")
        ids = tokenizer.encode(body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        if _flag(body, "add_special_tokens", False):
            raise bad("add_special_tokens", "add_special_tokens: a chat's template writes its own special "
                                            "tokens; only false is served with messages")
        if not _flag(body, "add_generation_prompt", True):
            raise bad("add_generation_prompt", "add_generation_prompt: only true is served (the prompt "
                                               "/v1/chat/completions sends)")
        chat = {k: body[k] for k in CHAT_KEYS if k in body}
        gen, _ = parse_chat_request(chat, render, tool_call_parser, reasoning_parser)
        ids = list(gen.prompts[0])
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(body: dict[str, Any], render: Any) -> dict[str, Any]:
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise bad(unknown[0], f"{unknown[0]} is not a /detokenize field (vLLM's: model, tokens)")
    tokenizer = _tokenizer(render)
    tokens = body.get("tokens")
    vocab = tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "tokens must be a list of token ids (integers)")
    wrong = next((t for t in tokens if not 0 <= t < vocab), None)
    if wrong is not None:
        raise bad("tokens", f"tokens: {wrong} is not a token id of this model (0 to {vocab - 1})")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}  # as vLLM (transformers' default)


def checkpoint_max_model_len(parameters: dict[str, str], model_path: Optional[str]) -> Optional[int]:
    """The engine's max_model_len: the config's parameter, or (0) the checkpoint's
    max_position_embeddings (its text_config's for a multimodal layout); None when neither is known."""
    value = parameters.get("max_model_len", "0").strip() or "0"
    if value.isdigit() and int(value) > 0:
        return int(value)
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    return None


class MaxModelLen:
    """The served max_model_len, read once from the model's config as Triton loaded it (None while
    Triton does not answer: asked again next time)."""

    def __init__(self, triton: Any, model_path: Optional[str]):
        self.triton, self.model_path, self.value = triton, model_path, None

    async def __call__(self) -> Optional[int]:
        from tritonclient.utils import InferenceServerException

        if self.value is None:
            try:
                config = (await self.triton.client.get_model_config(self.triton.model, as_json=True)).get("config", {})
            except InferenceServerException:
                return None
            parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
            self.value = checkpoint_max_model_len(parameters, parameters.get("model_path") or self.model_path)
        return self.value


__all__ = ["tokenize", "detokenize", "checkpoint_max_model_len", "MaxModelLen"]
