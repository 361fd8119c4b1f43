"""python -m openai_server: serve the OpenAI API for a running tritonserver."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from openai_server.reasoning import PARSERS as REASONING_PARSERS
from openai_server.tool_parsers import PARSERS as TOOL_CALL_PARSERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openai_server",
                                description="OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                                            "/v1/models) in front of the inflight model in Triton.")
    p.add_argument("--grpc-url", default="localhost:8001", help="Triton's gRPC address (default localhost:8001)")
    p.add_argument("--metrics-url", help="Triton's metrics endpoint, re-served on /metrics with the inference "
                                         "gateway's metrics (default: the gRPC host, port 8002)")
    p.add_argument("--model-path", help="the checkpoint folder Triton serves: its tokenizer and chat "
                                        "template render /v1/chat/completions")
    p.add_argument("--served-model-name", default="llm",
                   help="the model name clients pass and /v1/models lists (default llm, the Triton model)")
    p.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                   help="the format tool calls are written in and read from (vLLM's flag and names; default "
                        "hermes: <tool_call> JSON; llama3_json, qwen3_coder, mistral, pythonic, deepseek_v3)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="a reasoning model's format (vLLM's flag and names: qwen3, deepseek_r1): its thinking "
                        "goes to the message's reasoning (and reasoning_content), the answer to content")
    p.add_argument("--max-chat-messages", type=int, metavar="N",
                   help="a chat with more messages is a 400 naming the limit (default 10000)")
    p.add_argument("--max-chat-rendered-chars", type=int, metavar="N",
                   help="a chat whose rendered prompt is longer is a 400 naming the limit (default 4194304)")
    p.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' (one of these keys) on /v1, /tokenize and "
                        "/detokenize (vLLM's flag; default: $INFLIGHT_API_KEY, comma-separated, else $VLLM_API_KEY)")
    p.add_argument("--api-key-all-routes", action="store_true",
                   help="want the key on /health and /metrics too (open by default, for probes and scrapers)")
    p.add_argument("--enable-runtime-lora", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; also on with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); the model needs enable_runtime_lora=true too")
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="image_url file: URLs are read only under this folder (vLLM's flag; default: refused)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="image_url http(s) URLs are fetched only from these hosts (vLLM's flag; default: none)")
    p.add_argument("--media-fetch-timeout", type=float, default=5.0, metavar="S",
                   help="the longest an image URL's fetch may take, in seconds (default 5)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; the container's entrypoint passes 0.0.0.0)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_path and not Path(args.model_path).is_dir():
        print(f"openai_server: --model-path {args.model_path} is not a folder", file=sys.stderr)
        return 2
    from openai_server.auth import resolve_keys
    try:
        keys = resolve_keys(args.api_key)
    except ValueError as exc:
        print(f"openai_server: {exc}", file=sys.stderr)
        return 2
    if args.api_key_all_routes and not keys:
        print("openai_server: --api-key-all-routes needs a key (--api-key, $INFLIGHT_API_KEY or $VLLM_API_KEY)",
              file=sys.stderr)
        return 2
    import uvicorn

    from openai_server.app import create_app
    from openai_server.media import MediaPolicy

    limits = {k: v for k, v in (("max_chat_messages", args.max_chat_messages),
                                ("max_chat_rendered_chars", args.max_chat_rendered_chars)) if v is not None}
    app = create_app(args.grpc_url, args.model_path, args.served_model_name, args.tool_call_parser, args.metrics_url,
                     reasoning_parser=args.reasoning_parser, api_keys=tuple(keys),
                     api_key_all_routes=args.api_key_all_routes, runtime_lora=args.enable_runtime_lora,
                     media_policy=MediaPolicy(args.allowed_local_media_path, tuple(h.lower() for h in
                                                                                   args.allowed_media_domains),
                                              args.media_fetch_timeout), **limits)
    from backend.core.gc_heap import freeze_heap
    freeze_heap()  # the tokenizer, templates and routes: no full collection stalls every stream walking them again
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
