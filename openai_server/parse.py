"""python -m openai_server.parse: run the server's output parsers on a saved model output.

    python -m openai_server.parse --reasoning-parser qwen3 --tool-call-parser qwen3_coder \\
        --tools tools.json < output.txt
    {"content": ..., "reasoning": ..., "reasoning_content": ..., "tool_calls": [{"name", "arguments"}]}

For users debugging a chat template or a parser, and for tests: the message is what the OpenAI
server would answer for that text. `--stream-chunk N` feeds the text N characters at a time, as a
stream arrives, and prints what the merged stream adds up to (it must be the same message);
`--jsonl` reads one {"output": ..., "tools": [...], "prompt": ...} object a line and prints one
message a line. `--prompt-state` (open | closed | none) says where the prompt left the thinking
(reasoning.prompt_state); a line's `prompt` text decides it per line.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from openai_server.reasoning import PARSERS as REASONING_PARSERS, ReasoningParser, prompt_state, with_reasoning
from openai_server.tool_parsers import PARSERS as TOOL_CALL_PARSERS, make_parser


class OutputParser:
    """One choice's output read as it arrives: reasoning first, then tool calls in the answer.
    feed() and finish() return the delta (reasoning, content, tool-call events)."""

    def __init__(self, reasoning_parser: Optional[str], tool_call_parser: Optional[str],
                 schemas: Optional[dict[str, Any]] = None, prompt: str = "none"):
        self.reasoning = ReasoningParser(reasoning_parser, prompt) if reasoning_parser else None
        self.tools = make_parser(tool_call_parser, schemas) if tool_call_parser else None

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[tuple]]:
        if self.reasoning is None:
            thought, answer = "", text
        else:
            thought, answer = self.reasoning.feed(text)
            if final:
                more_thought, more_answer = self.reasoning.finish()
                thought, answer = thought + more_thought, answer + more_answer
        if self.tools is None:
            return thought, answer, []
        events = self.tools.feed(answer) + (self.tools.finish() if final else [])
        return thought, "".join(e[1] for e in events if e[0] == "content"), [e for e in events if e[0] != "content"]

    @property
    def thought(self) -> bool:
        return self.reasoning is not None and self.reasoning.thought

    @property
    def tool_calls(self) -> list[dict]:
        return [] if self.tools is None else self.tools.tool_calls


def parse_output(text: str, reasoning_parser: Optional[str], tool_call_parser: Optional[str],
                 tools: Optional[list[dict]] = None, stream_chunk: int = 0, prompt: str = "none") -> dict[str, Any]:
    """The message the server makes of `text` (fed whole, or `stream_chunk` characters at a time)."""
    pieces = [text[i:i + stream_chunk] for i in range(0, len(text), stream_chunk)] if stream_chunk > 0 else [text]
    return parse_pieces(pieces, reasoning_parser, tool_call_parser, tools, prompt)


def parse_pieces(pieces: Sequence[str], reasoning_parser: Optional[str], tool_call_parser: Optional[str],
                 tools: Optional[list[dict]] = None, prompt: str = "none") -> dict[str, Any]:
    """The message a stream of these text pieces adds up to (the last one ends it)."""
    parser = OutputParser(reasoning_parser, tool_call_parser, schemas_of(tools), prompt)
    pieces = list(pieces) or [""]
    thought, content = [], []
    for i, piece in enumerate(pieces):
        r, c, _ = parser.feed(piece, final=i == len(pieces) - 1)
        thought.append(r)
        content.append(c)
    return message(parser, "".join(thought), "".join(content))


def message(parser: OutputParser, thought: str, content: str) -> dict[str, Any]:
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in parser.tool_calls]
    keep = content.strip() if calls else content  # as the server: blank text beside calls is none
    out: dict[str, Any] = {"content": content if keep else None}
    with_reasoning(out, thought if parser.thought else None)
    out["tool_calls"] = calls
    return out


def schemas_of(tools: Optional[list[dict]]) -> dict[str, Any]:
    """OpenAI tools (or bare function objects) -> function name -> its parameters schema."""
    out = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            out[function["name"]] = function.get("parameters") or {}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openai_server.parse",
                                description="Parse a saved model output as the OpenAI server does; print the message.")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS)
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS)
    p.add_argument("--tools", metavar="FILE", help="a JSON list of the request's tools (types qwen3_coder's values)")
    p.add_argument("--stream-chunk", type=int, default=0, metavar="N",
                   help="feed the text N characters at a time and print the merged stream")
    p.add_argument("--jsonl", action="store_true",
                   help='stdin has one {"output": ..., "tools": [...]} object a line; print one message a line')
    p.add_argument("--prompt-state", choices=("none", "open", "closed"), default="none",
                   help="where the prompt left the thinking: open (it ends in <think>), closed, none (default)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.reasoning_parser and not args.tool_call_parser:
        print("python -m openai_server.parse: give --reasoning-parser, --tool-call-parser or both", file=sys.stderr)
        return 2
    tools = None
    if args.tools:
        with open(args.tools, encoding="utf-8") as f:
            tools = json.load(f)
    if not args.jsonl:
        print(json.dumps(parse_output(sys.stdin.read(), args.reasoning_parser, args.tool_call_parser, tools,
                                      args.stream_chunk, args.prompt_state), ensure_ascii=False))
        return 0
    for n, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["output"]
        except (ValueError, KeyError, TypeError):
            print(f"python -m openai_server.parse: line {n} is not a JSON object with \"output\"", file=sys.stderr)
            return 2
        state = prompt_state(row["prompt"]) if isinstance(row.get("prompt"), str) else args.prompt_state
        print(json.dumps(parse_output(text, args.reasoning_parser, args.tool_call_parser, row.get("tools", tools),
                                      args.stream_chunk, state), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
