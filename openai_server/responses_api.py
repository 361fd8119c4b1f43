"""OpenAI's /v1/responses, stateless, translated onto the chat path (docs/openai.md).

The request becomes a /v1/chat/completions body (`to_chat`): `instructions` a system message, the
input's messages, function calls and their outputs the chat's turns and tool messages, function
`tools` and `tool_choice` the chat's, `text.format` its `response_format` (structured outputs),
`reasoning.effort` the template's thinking switch (`enable_thinking`: off for "none" and "minimal",
on otherwise, beside `reasoning_effort`), `max_output_tokens` its `max_completion_tokens`. The chat
path renders, constrains, generates and parses it (tools, reasoning) as for any chat; its answer is
rewritten as a Response (`from_chat`), or its stream as the Responses events (`Events`).

Nothing is stored: `store: true` and `previous_response_id` are refused (400 naming them), so a
conversation is sent whole each time, its function calls and outputs as input items.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from openai_server.translate import APIError, bad

# vLLM's sampling extras a Responses body may carry, passed to the chat path as they are
PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "logit_bias", "stop", "min_tokens", "ignore_eos", "chat_template_kwargs",
          "thinking_token_budget", "parallel_tool_calls", "user")
OWN = ("model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
       "stream", "store", "previous_response_id", "metadata", "truncation", "include", "background")
THINKING_OFF = ("none", "minimal")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or its text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad("input", f"{where}.content[{j}]: only text parts are served (input_text, output_text), "
                                   f"not {kind}")
            texts.append(part["text"])
        return "".join(texts)
    raise bad("input", f"{where}.content must be a string or a list of text parts")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad("input", f"{where}: a function_call needs call_id, name and arguments (strings)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn stay in one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad("input", f"{where}: a function_call_output needs its call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), where)})
        elif kind == "reasoning":
            continue  # an earlier answer's thinking: the chat template drops it from past turns too
        else:
            raise bad("input", f"{where}: items are messages (user, system, developer, assistant), function_call, "
                               f"function_call_output or reasoning; got {json.dumps(item)[:60]}")
    return messages


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad("tools", "tools must be a list")
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else tool
                raise bad("tools", f"tools[{i}]: only function tools are served, not {kind!r}")
            chat_tools.append({"type": "function", "function": {k: tool[k] for k in
                                                                ("name", "description", "parameters", "strict")
                                                                if tool.get(k) is not None}})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("tool_choice", "tool_choice: a string (auto, none, required) or {\"type\": \"function\", "
                                     "\"name\": ...}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: dict[str, Any]) -> Optional[dict[str, Any]]:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise bad("text", "text.format: {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                      "\"name\", \"schema\"}")


def _thinking(body: dict[str, Any]) -> dict[str, Any]:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return {}
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise bad("reasoning", f"reasoning.effort must be one of {', '.join(EFFORTS)}")
    return {"enable_thinking": effort not in THINKING_OFF, "reasoning_effort": effort}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/responses body -> the /v1/chat/completions body that serves it (400 naming a field the
    translation refuses; the chat path checks the rest)."""
    unknown = sorted(set(body) - set(OWN) - set(PASSED))
    if unknown:
        raise bad(unknown[0], f"{unknown[0]} is not a /v1/responses field this server takes")
    if body.get("store"):
        raise bad("store", "store: true is not served: this server keeps no responses (send store: false, and "
                           "the whole conversation as input)")
    if body.get("previous_response_id") is not None:
        raise bad("previous_response_id", "previous_response_id is not served: this server keeps no responses; "
                                          "send the earlier turns as input items")
    if body.get("background"):
        raise bad("background", "background: true is not served")
    if body.get("truncation", "disabled") != "disabled":
        raise bad("truncation", "truncation: only \"disabled\" is served")
    if body.get("include"):
        raise bad("include", "include: nothing more than the output is served")
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat.update(model=body.get("model"), messages=_messages(body), **_tools(body))
    fmt = _format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    thinking = _thinking(body)
    if thinking:  # the request's own chat_template_kwargs win
        chat["chat_template_kwargs"] = {**thinking, **(chat.get("chat_template_kwargs") or {})}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream"):
        chat.update(stream=True, stream_options={"include_usage": True})
    return chat


# -- the answer ---------------------------------------------------------------------------------------

def output_item(kind: str, item_id: str, value: Any, done: bool = True) -> dict[str, Any]:
    """An output item: reasoning (value: its text), message (its text) or function_call (a chat call)."""
    status = "completed" if done else "in_progress"
    if kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": value}] if done else []}
    if kind == "message":
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": [text_part(value)] if done else []}
    return {"id": item_id, "type": "function_call", "call_id": value["id"], "name": value["name"],
            "arguments": value["arguments"] if done else "", "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Answer:
    """The Response object of one request, filled by a whole chat answer or a stream's pieces."""

    def __init__(self, body: dict[str, Any], count_tokens: Callable[[str], int]):
        self.body, self.count_tokens = body, count_tokens
        self.id, self.created = new_id("resp"), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.usage: Optional[dict[str, Any]] = None
        self.finish: Optional[str] = None

    def response(self, status: Optional[str] = None) -> dict[str, Any]:
        b = self.body
        incomplete = self.finish == "length"
        status = status or ("incomplete" if incomplete else "completed")
        reasoning = "".join(c["text"] for i in self.output if i["type"] == "reasoning" for c in i["content"])
        usage = None
        if self.usage is not None:
            u = self.usage
            usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                     "total_tokens": u["total_tokens"],
                     "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get(
                         "cached_tokens", 0)},
                     # the thinking's tokens, counted by encoding its text again
                     "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0}}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": b.get("model"), "output": self.output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status == "incomplete" else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto"),
                "parallel_tool_calls": b.get("parallel_tool_calls", True), "text": b.get("text") or {"format": {"type": "text"}},
                "reasoning": b.get("reasoning"), "store": False, "previous_response_id": None,
                "metadata": b.get("metadata") or {}, "truncation": "disabled", "user": b.get("user")}

    def from_chat(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A chat.completion body -> the Response."""
        choice = answer["choices"][0]
        message = choice["message"]
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning:
            self.output.append(output_item("reasoning", new_id("rs"), reasoning))
        if message.get("content"):
            self.output.append(output_item("message", new_id("msg"), message["content"]))
        for call in message.get("tool_calls") or []:
            self.output.append(output_item("function_call", new_id("fc"), {**call["function"], "id": call["id"]}))
        self.finish, self.usage = choice.get("finish_reason"), answer.get("usage")
        return self.response()


def event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode("utf-8")


async def events(chunks: AsyncIterator[bytes], answer: Answer) -> AsyncIterator[bytes]:
    """A chat completion's SSE chunks -> the Responses events (docs/openai.md lists them in order)."""
    from openai_server.responses_stream import EventWriter

    writer = EventWriter(answer)
    try:
        yield event(writer.next("response.created", response=answer.response("in_progress")))
        yield event(writer.next("response.in_progress", response=answer.response("in_progress")))
        async for raw in chunks:
            data = raw.decode("utf-8")[len("data: "):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                yield event(writer.next("error", code=error.get("code"), message=error.get("message"),
                                        param=error.get("param")))
                return
            for out in writer.chunk(chunk):
                yield event(out)
        for out in writer.close():
            yield event(out)
        final = answer.response()
        yield event(writer.next(f"response.{final['status']}", response=final))
    finally:  # the chat stream's own clean-up (its Triton requests cancelled) runs too
        await chunks.aclose()


__all__ = ["to_chat", "Answer", "events", "event", "output_item", "text_part", "new_id"]
