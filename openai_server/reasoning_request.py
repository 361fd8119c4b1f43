"""The request side of reasoning models on /v1/chat/completions: vLLM's `chat_template_kwargs` (more
variables for the chat template, e.g. Qwen3's {"enable_thinking": false}) and
`thinking_token_budget` (at most that many tokens of thinking, forced by the grammar:
constraints.answer_only), `include_reasoning` (vLLM's: false drops the reasoning field of the
message and the deltas; the thinking never reaches `content` either way), and where the rendered prompt leaves the thinking (reasoning.prompt_state),
which tells the parser whether the output starts inside it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from backend.core.structured import StructuredOutputs
from openai_server.constraints import EXTRA_FIELDS, FieldError, answer_only
from openai_server.reasoning import prompt_state

if TYPE_CHECKING:
    from openai_server.translate import Generation

# Template variables the server sets itself (and render's own arguments): not the request's to set.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "tools_fallback", "template",
                            "special_tokens")


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise FieldError("chat_template_kwargs", "chat_template_kwargs must be an object of template "
                                                 "variables (names as keys)")
    taken = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if taken:
        raise FieldError("chat_template_kwargs", f"chat_template_kwargs: {', '.join(taken)} is set by the "
                                                 "server, not by the request")
    return dict(kwargs)


def thinking_budget(body: dict[str, Any], reasoning_parser: Optional[str]) -> Optional[int]:
    budget = body.get("thinking_token_budget")
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise FieldError("thinking_token_budget", "thinking_token_budget must be an integer >= 0")
    if reasoning_parser is None:
        raise FieldError("thinking_token_budget", "thinking_token_budget needs a reasoning model: start the "
                                                  "server with --reasoning-parser")
    return budget


def prompt_state_of(render: Any, prompt: Any) -> str:
    """prompt_state of a rendered prompt: its text, or its token ids read by `render`'s tokenizer."""
    if isinstance(prompt, str):
        return prompt_state(prompt)
    tokenizer = getattr(render, "tokenizer", None)
    if tokenizer is None or not prompt:
        return "none"
    return prompt_state(tokenizer.decode(prompt[-8:], skip_special_tokens=False))


# The request fields read here (the translator's field list does not know them).
FIELDS = ("chat_template_kwargs", "thinking_token_budget", "include_reasoning")


@dataclass
class Thinking:
    """What a chat answer's parser needs: the reasoning format and where the prompt left the thinking."""
    parser: Optional[str] = None
    prompt: str = "none"
    include: bool = True  # vLLM's include_reasoning: false drops the reasoning field (the thinking is still split off)


def parse_chat_request(body: dict[str, Any], render: Callable[..., Any], tool_call_parser: str,
                       reasoning_parser: Optional[str]) -> tuple["Generation", Thinking]:
    """translate.parse_chat with this module's fields: the template's variables passed to `render`,
    the rendered prompt's thinking state found, the constraint moved after the thinking."""
    from openai_server.translate import bad, parse_chat

    try:
        variables = template_kwargs(body)
        budget = thinking_budget(body, reasoning_parser)
        include = body.get("include_reasoning", True)
        if not isinstance(include, bool):
            raise FieldError("include_reasoning", "include_reasoning must be a boolean")
    except FieldError as exc:
        raise bad(exc.param, str(exc)) from None
    rendered: list[Any] = []

    def render_with(messages: list[dict[str, Any]], **kw: Any) -> Any:
        rendered.append(render(messages, **kw, **variables))
        return rendered[-1]

    gen = parse_chat({k: v for k, v in body.items() if k not in FIELDS}, render_with, tool_call_parser)
    if reasoning_parser is None:
        return gen, Thinking()
    state = prompt_state_of(render, rendered[-1]) if rendered else "none"
    spec = gen.sampling.get("structured_outputs")
    param = next((k for k in ("response_format",) + EXTRA_FIELDS if body.get(k) is not None),
                 "tool_choice" if spec is not None else "thinking_token_budget")
    try:
        spec = answer_only(spec, param, reasoning_parser, state, budget)
        if spec is not None:
            StructuredOutputs.parse(spec)
    except ValueError as exc:
        raise bad(getattr(exc, "param", param), str(exc)) from None
    if spec is not None:
        gen.sampling["structured_outputs"] = spec
    return gen, Thinking(reasoning_parser, state, include)
