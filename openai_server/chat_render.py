"""A chat's messages -> its prompt token ids, by the checkpoint's chat template (the OpenAI server's
/v1/chat/completions and /v1/responses; tests build the ids the server sends with it)."""
from __future__ import annotations

from typing import Any, Optional

from openai_server.translate import APIError, bad

DEFAULT_MAX_CHAT_RENDERED_CHARS = 4 << 20  # ~1M tokens: past any context the server could serve


class ChatRenderer:
    """Messages -> prompt token ids, by the checkpoint's chat template. The ids are sent (not the
    text) because the template writes its own special tokens: the text must be encoded without the
    tokenizer's BOS, as vLLM and transformers encode a rendered chat."""

    def __init__(self, model_path: Optional[str], max_rendered_chars: int = DEFAULT_MAX_CHAT_RENDERED_CHARS):
        from backend.text.tokenizer import Tokenizer

        self.model_path = model_path
        self.max_rendered_chars = max_rendered_chars
        self.tokenizer = Tokenizer.from_dir(model_path) if model_path else None

    def __call__(self, messages: list[dict[str, Any]], **variables: Any) -> list[int]:
        from backend.text.chat_template import ChatTemplateError

        if self.tokenizer is None:
            raise APIError(400, "chat needs the model's tokenizer and chat template: start the server "
                                "with --model-path (inflight serve passes it); /v1/completions works without")
        if self.tokenizer.chat_template is None:
            raise bad("messages", f"the served model ({self.model_path}) has no chat template; "
                                  "use /v1/completions with a prompt instead")
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=True, **variables)  # tools
        except ChatTemplateError as exc:
            raise bad("messages", str(exc)) from None
        except (TypeError, ValueError, LookupError, RuntimeError) as exc:  # the template on these messages
            raise bad("messages", f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None
        if len(text) > self.max_rendered_chars:
            raise bad("messages", f"the rendered chat is {len(text)} characters; the limit is {self.max_rendered_chars} "
                                  "(--max-chat-rendered-chars)")
        # encode_batch lets go of the GIL while it tokenizes (encode holds it: 1.9 s on 50k messages),
        # so the event loop runs beside a long prompt
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0]
