"""Chat templates: a checkpoint's Jinja template turns a list of messages into the prompt text.

Templates come with checkpoints, so they are untrusted code. They are rendered as transformers'
``apply_chat_template`` renders them, in jinja2's ``ImmutableSandboxedEnvironment``: attribute access
to internals (``__class__``, ``__mro__``, ``__globals__``...) and calls of unsafe methods raise
``jinja2.exceptions.SecurityError``, and the data the template sees cannot be modified in place. The
messages are copied into plain JSON values first, so no caller object with methods reaches it.

The environment matches transformers' so that templates written for it render the same text:
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``), a ``tojson``
filter that keeps non-ASCII text, and the globals ``raise_exception(message)`` and
``strftime_now(format)``. The special tokens (``bos_token``, ``eos_token``...) are variables.

Tools (OpenAI tool calling) go to the template as its ``tools`` variable, as transformers passes
them. A template that never reads ``tools`` would drop them without a word: the caller's
``tools_fallback`` then rewrites the messages instead (the OpenAI server's puts the tools in the
system message: openai_server/tools.py).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["ChatTemplateError", "compile_template", "render_chat_template", "reads_variable"]


class ChatTemplateError(ValueError):
    """A chat template that fails to render (its own ``raise_exception``, a syntax error, or a
    sandbox violation); the message says which."""


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled template (cached by its text)."""
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error (line {exc.lineno}): {exc.message}") from None


@lru_cache(maxsize=16)
def reads_variable(source: str, name: str) -> bool:
    """Whether the template reads the variable `name` (e.g. ``tools``) anywhere."""
    from jinja2 import TemplateSyntaxError, meta

    try:
        return name in meta.find_undeclared_variables(_environment().parse(source))
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error (line {exc.lineno}): {exc.message}") from None


def _plain(value: Any, where: str = "messages") -> Any:
    """A deep copy made only of JSON types (dict, list, str, int, float, bool, None)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where}: a value of type {type(value).__name__} cannot be passed to a chat "
                            "template (only JSON values)")


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]],
                         add_generation_prompt: bool = True,
                         special_tokens: Optional[Mapping[str, Optional[str]]] = None,
                         tools_fallback: Optional[Callable[[list, list], list]] = None,
                         **variables: Any) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with ``template``.

    ``add_generation_prompt`` appends the opening of the assistant's turn, so that the model's
    continuation is the answer. ``special_tokens`` (``bos_token``, ``eos_token``...) and any other
    ``variables`` (``tools``, ``documents``...) are passed to the template as variables. When
    ``tools`` are given and the template never reads them, ``tools_fallback(messages, tools)``
    returns the messages to render in their place.
    Raises ChatTemplateError for bad messages or a template that fails, including on a sandbox
    violation.
    """
    from jinja2.exceptions import SecurityError, TemplateError

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
    if variables.get("tools") and tools_fallback is not None and not reads_variable(template, "tools"):
        messages = tools_fallback(list(messages), list(variables["tools"]))
    context = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    context.update(_plain(variables, "variables"))
    compiled = compile_template(template)
    try:
        return compiled.render(messages=_plain(list(messages)),
                               add_generation_prompt=bool(add_generation_prompt), **context)
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template refused by the sandbox: {exc}") from exc
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
