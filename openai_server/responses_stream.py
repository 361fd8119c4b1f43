"""The Responses API's stream events, written from a chat completion's stream (responses_api.py).

Each output item opens (`response.output_item.added`; a text item's `response.content_part.added`),
grows by deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`) and closes (the matching `.done` events, then
`response.output_item.done`) before the next one opens; every event carries its
`sequence_number`."""
from __future__ import annotations

from typing import Any, Optional

from openai_server.responses_api import Answer, new_id, output_item, text_part

TEXT = {"reasoning": ("response.reasoning_text", "reasoning_text"), "message": ("response.output_text", "output_text")}


class EventWriter:
    def __init__(self, answer: Answer):
        self.answer = answer
        self.sequence = 0
        self.kind: Optional[str] = None  # the open item: reasoning, message, function_call
        self.id = ""
        self.index = -1  # its output_index
        self.text = ""   # its text, or a call's arguments
        self.call: dict[str, Any] = {}
        self.call_index: Optional[int] = None  # the chat's index of the open call

    def next(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index}

    def _open(self, kind: str, call: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
        out = self.close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.kind, self.id, self.text, self.index = kind, new_id(prefix), "", len(self.answer.output)
        self.call = call or {}
        item = output_item(kind, self.id, self.call if kind == "function_call" else "", done=False)
        self.answer.output.append(item)
        out.append(self.next("response.output_item.added", output_index=self.index, item=item))
        if kind in TEXT:
            part = {"type": TEXT[kind][1], "text": ""} if kind == "reasoning" else text_part("")
            out.append(self.next("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def close(self) -> list[dict[str, Any]]:
        """The open item's closing events (none when no item is open)."""
        if self.kind is None:
            return []
        out = []
        if self.kind == "function_call":
            call = {**self.call, "arguments": self.text}
            item = output_item("function_call", self.id, call)
            out.append(self.next("response.function_call_arguments.done", **self._where(), name=call["name"],
                                 arguments=self.text))
        else:
            item = output_item(self.kind, self.id, self.text)
            done = {"text": self.text, "logprobs": []} if self.kind == "message" else {"text": self.text}
            out.append(self.next(f"{TEXT[self.kind][0]}.done", **self._where(), content_index=0, **done))
            out.append(self.next("response.content_part.done", **self._where(), content_index=0,
                                 part=item["content"][0]))
        self.answer.output[self.index] = item
        out.append(self.next("response.output_item.done", output_index=self.index, item=item))
        self.kind, self.call_index = None, None
        return out

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        out = self._open(kind) if self.kind != kind else []
        self.text += delta
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.next(f"{TEXT[kind][0]}.delta", **self._where(), content_index=0, delta=delta, **extra))
        return out

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat.completion.chunk -> its events."""
        if chunk.get("usage"):
            self.answer.usage = chunk["usage"]
        if not chunk.get("choices"):
            return []
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        out: list[dict[str, Any]] = []
        reasoning = delta.get("reasoning") if "reasoning" in delta else delta.get("reasoning_content")
        if reasoning:
            out += self._text("reasoning", reasoning)
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if self.kind != "function_call" or call.get("index") != self.call_index:
                out += self._open("function_call", {"id": call.get("id") or new_id("call"),
                                                    "name": function.get("name") or "", "arguments": ""})
                self.call_index = call.get("index")
            if function.get("arguments"):
                self.text += function["arguments"]
                out.append(self.next("response.function_call_arguments.delta", **self._where(),
                                     delta=function["arguments"]))
        if choice.get("finish_reason"):
            self.answer.finish = choice["finish_reason"]
        return out


__all__ = ["EventWriter"]
