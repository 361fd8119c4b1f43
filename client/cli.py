"""The `inflight` command line: make-model, config, serve, generate, bench."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Optional, Sequence

from openai_server.reasoning import PARSERS as REASONING_PARSERS
from openai_server.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from templates.render import parse_param, positive_int

REPO_ROOT = Path(__file__).resolve().parents[1]


def _make_model(argv: list[str]) -> int:
    from backend.models.make_model import main
    return main(argv) or 0


def _bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module("client.tools.benchmarks.bench")
    except ModuleNotFoundError as exc:
        if exc.name != "client.tools.benchmarks.bench":
            raise
        print("inflight bench: not yet available in this checkout (client/tools/benchmarks/bench.py is missing)",
              file=sys.stderr)
        return 2
    return bench.main(argv) or 0


def _config(args: argparse.Namespace) -> int:
    from templates.render import run
    return run(args)


def _generate(args: argparse.Namespace) -> int:
    from client.protocol import GenerationError

    options = {k: v for k, v in dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop_words=args.stop or None, ignore_eos=args.ignore_eos or None,
        min_tokens=args.min_tokens, lora_name=args.lora_name,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, bad_words=args.bad_word or None, logprobs=args.logprobs,
        exclude_input_in_output=True if args.stream else (not args.echo),
    ).items() if v is not None}
    protocol = args.protocol or ("http" if args.url and args.url.startswith(("http://", "https://")) else "grpc")
    if protocol == "grpc":
        from client.grpc_client import DEFAULT_URL, GrpcClient
        client = GrpcClient(args.url or DEFAULT_URL)
        chunks = lambda: client.stream(args.prompt, stream=args.stream, **options)  # noqa: E731
    else:
        from client.http_client import DEFAULT_URL, HttpClient
        client = HttpClient(args.url or DEFAULT_URL)
        if args.stream:
            chunks = lambda: client.stream(args.prompt, **options)  # noqa: E731
        else:  # one response: the Result has the chunk's text and finish_reason
            chunks = lambda: [client.generate(args.prompt, **options)]  # noqa: E731
    reason, cumulative = None, None
    try:
        for chunk in chunks():
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            reason = chunk.finish_reason or reason
            cumulative = chunk.cumulative_logprob if chunk.cumulative_logprob is not None else cumulative
    except GenerationError as exc:
        print(f"\ninflight generate: {exc}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as exc:
        print(f"\ninflight generate: cannot reach the server ({exc}); is `inflight serve` running?",
              file=sys.stderr)
        return 1
    except Exception as exc:  # tritonclient raises its own exception type for transport errors
        if type(exc).__name__ != "InferenceServerException":
            raise
        print(f"\ninflight generate: {exc}", file=sys.stderr)
        return 1
    print()
    if args.verbose:
        print(f"[finish_reason: {reason}]" + (f" [cumulative_logprob: {cumulative:.4f}]"
                                              if cumulative is not None else ""), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inflight",
        description="An LLM backend for Triton Inference Server: in-flight batching, paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("make-model", add_help=False,
                   help="write the small random-weight default model (see `inflight make-model --help`)")

    from templates.render import add_arguments
    p = sub.add_parser("config", help="render model_repository/llm/config.pbtxt from the template")
    add_arguments(p)

    p = sub.add_parser("serve", help="run the local tritonserver on the model repository")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--host", default="127.0.0.1",
                   help="address Triton's ports and the OpenAI API listen on (default 127.0.0.1: this machine "
                        "only; 0.0.0.0: every interface, for a trusted network or behind a proxy)")
    p.add_argument("--model-path", help="serve this Hugging Face checkpoint folder")
    p.add_argument("--param", action="append", type=parse_param, default=[], metavar="KEY=VALUE",
                   help="override a config.pbtxt parameter for this run (repeatable)")
    p.add_argument("--tp", type=positive_int, metavar="N",
                   help="tensor_parallel_size: run each engine on N ranks (docs/parallelism.md)")
    p.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the model to load (default 600)")
    p.add_argument("--no-restart", action="store_true",
                   help="exit when tritonserver or a model's process dies (default: start it again, at most "
                        "once a minute; docs/reliability.md)")
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of the OpenAI-compatible API started beside tritonserver (default 9000; 0: none)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                        "or '{\"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 3}' (the speculative_config parameter)")
    p.add_argument("--runner", choices=("auto", "generate", "pooling"),
                   help="vLLM's --runner (the runner parameter): generate serves tokens, pooling embeddings and "
                        "scores (/v1/embeddings, /v1/score, /v1/rerank; docs/pooling.md); auto (the parameter's "
                        "default) picks pooling for an embedding or reranker checkpoint")
    p.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                   help="the tool-call format of the OpenAI server's chat (vLLM's names; default hermes: "
                        "<tool_call> JSON)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="the OpenAI server's reasoning format (vLLM's names): thinking goes to reasoning, the "
                        "answer to content (default: none)")
    p.add_argument("--api-key", nargs="+", action="extend", default=[], metavar="KEY",
                   help="the OpenAI API wants 'Authorization: Bearer KEY' (one of these keys) on /v1, /tokenize and "
                        "/detokenize (vLLM's flag; default: $INFLIGHT_API_KEY, else $VLLM_API_KEY; docs/security.md)")
    p.add_argument("--api-key-all-routes", action="store_true",
                   help="the OpenAI API wants the key on /health and /metrics too")
    p.add_argument("--max-chat-messages", type=int, metavar="N",
                   help="the OpenAI API refuses a chat of more messages with a 400 naming the limit (default 10000)")
    p.add_argument("--max-chat-rendered-chars", type=int, metavar="N",
                   help="the OpenAI API refuses a chat whose rendered prompt is longer (default 4194304)")
    p.add_argument("--limit-mm-per-prompt", metavar="N|JSON",
                   help="vLLM's flag (the limit_mm_per_prompt parameter): the most images one prompt may carry, "
                        "N or '{\"image\": N}' (default 8; docs/vision.md)")
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="the OpenAI API reads image_url file: URLs only under this folder (vLLM's flag; default: "
                        "refused)")
    p.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                   help="the OpenAI API fetches image_url http(s) URLs only from these hosts (vLLM's flag)")
    p.add_argument("--media-fetch-timeout", type=float, metavar="S",
                   help="the longest an image URL's fetch may take (default 5 s)")
    p.add_argument("--triton-arg", action="append", default=[], metavar="ARG",
                   help="pass a flag to tritonserver as it is, written with '=': --triton-arg=--http-restricted-api="
                        "model-repository,statistics:admin-key=SECRET (repeatable; docs/triton.md)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve beside the model's multi_lora.json, as vLLM's "
                        "flag: NAME=PATH or a JSON {\"name\": ..., \"path\": ...}; turns enable_lora on. "
                        "Requests pick one with lora_name, the OpenAI API with model (docs/lora.md)")
    p.add_argument("--enable-runtime-lora", action="store_true",
                   help="load and unload LoRA adapters while serving: the OpenAI API's /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter (vLLM's), Triton's lora_action requests; turns enable_lora and "
                        "enable_runtime_lora on (also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; docs/lora.md)")

    p = sub.add_parser("generate", help="send one prompt and print the answer as it arrives")
    p.add_argument("prompt")
    p.add_argument("--stream", action="store_true", help="print each step's text as it arrives")
    p.add_argument("--url", help="server address (default localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--protocol", choices=("grpc", "http"),
                   help="default grpc (http when --url starts with http://)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeats (vLLM's formula)")
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--bad-word", action="append", default=[], metavar="TEXT", help="never generate it (repeatable)")
    p.add_argument("--lora-name", help="run with this LoRA adapter (one the server loaded)")
    p.add_argument("--logprobs", type=int, metavar="K",
                   help="compute logprobs (K top candidates); -v prints the cumulative logprob")
    p.add_argument("--echo", action="store_true", help="print the prompt before the answer (non-streaming)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the finish reason")

    sub.add_parser("bench", add_help=False, help="benchmark a running server (see `inflight bench --help`)")

    # -- import-gguf (backend/models/gguf/importer.py parses its own arguments) --
    sub.add_parser("import-gguf", add_help=False,
                   help="convert a GGUF file into a checkpoint folder (see `inflight import-gguf --help`)")

    # -- gpu-check (client/tools/gpu_check/run.py parses its own arguments) --
    sub.add_parser("gpu-check", add_help=False,
                   help="the GPU acceptance script, or its CPU rehearsal (see `inflight gpu-check --help`)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-model":
        return _make_model(argv[1:])
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "import-gguf":  # FILE --out DIR [--dtype] [--force]
        from backend.models.gguf.importer import main as import_gguf_main
        return import_gguf_main(argv[1:])
    if argv and argv[0] == "gpu-check":  # [--dry-run] [--out DIR]
        from client.tools.gpu_check.run import main as gpu_check_main
        return gpu_check_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from client.serve import serve
        return serve(args)
    return {"config": _config, "generate": _generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
