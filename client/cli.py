"""The `inflight` command line: make-model, config, serve, generate, bench."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from openai_server.reasoning import PARSERS as REASONING_PARSERS
from openai_server.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from templates.render import parse_param, positive_int, stale_warning, tensor_parallel_problem

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


def _supervise(server, args: argparse.Namespace) -> int:
    """Watch the ready server; when tritonserver or a model's Python stub dies (a stub stalled a
    second while tritonserver waited on it kills one or the other: docs/reliability.md), start it
    again on the same ports, unless --no-restart or the last such start was under RESTART_INTERVAL
    ago (a crash loop). The exit code once it gives up."""
    from serving.stub_watch import RESTART_INTERVAL

    restarted = None  # when it was last started again
    while True:
        failure = server.failure()
        if failure is None:
            time.sleep(0.5)
            continue
        looping = restarted is not None and time.monotonic() - restarted < RESTART_INTERVAL
        if args.no_restart or looping:
            print(f"inflight serve: {failure}" + (f" within {RESTART_INTERVAL:.0f} s of starting it again: "
                  "not starting it again" if looping else ""), file=sys.stderr)
            code = server.process.returncode if server.process is not None else None
            return code or 1
        print(f"inflight serve: {failure}; starting tritonserver again (--no-restart: exit instead)",
              file=sys.stderr)
        told = len(server.recoveries)
        server.restart(args.ready_timeout)
        restarted = time.monotonic()
        for note in server.recoveries[told:]:  # that start hung too, and was ended and retried
            print(f"inflight serve: {note}", file=sys.stderr)
        print("inflight serve: ready again", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    from serving.openai_launcher import OpenAIServer, OpenAIServerError
    from serving.triton_launcher import MODEL_NAME, ServerError, TritonServer
    from templates.render import DEFAULT_OUTPUT, read_parameters, write_config

    params = dict(args.param)
    if args.speculative_config is not None:  # checked now: a bad value is refused before Triton starts
        from backend.core.speculative_config import parse_speculative_config, resolve_draft_path
        try:
            parse_speculative_config(args.speculative_config)
        except ValueError as exc:
            print(f"inflight serve: --speculative-config: {exc}", file=sys.stderr)
            return 2
        params["speculative_config"] = resolve_draft_path(args.speculative_config, Path.cwd())
    if args.runner is not None:  # vLLM's --runner: the runner parameter (docs/pooling.md)
        params["runner"] = args.runner
    if args.limit_mm_per_prompt is not None:  # vLLM's flag: the limit_mm_per_prompt parameter (docs/vision.md)
        params["limit_mm_per_prompt"] = args.limit_mm_per_prompt
    repository = Path(args.model_repository)
    config = repository / MODEL_NAME / "config.pbtxt"
    if not config.exists():
        if config.resolve() != DEFAULT_OUTPUT.resolve():
            print(f"inflight serve: {config} does not exist", file=sys.stderr)
            return 2
        write_config(config)
        print(f"inflight serve: rendered {config} (edit it to tune the engine)")
    stale = stale_warning(config, config.read_text())
    if stale:
        print(f"inflight serve: warning: {stale}", file=sys.stderr)
    if args.tp is not None:
        params["tensor_parallel_size"] = str(args.tp)
        problem = tensor_parallel_problem(config.read_text(), args.tp)
        if problem:
            print(f"inflight serve: {problem}", file=sys.stderr)
            return 2
    if args.lora_modules:  # vLLM's flag: the adapters, and LoRA on (docs/lora.md)
        params.update(lora_params(args.lora_modules, params))
    from openai_server.lora_api import runtime_lora_enabled
    if runtime_lora_enabled(args.enable_runtime_lora):  # the flag or vLLM's variable: both doors (docs/lora.md)
        args.enable_runtime_lora = True
        params.update(enable_lora="true", enable_runtime_lora="true")
    model_path = args.model_path or params.get("model_path") or read_parameters(config.read_text()).get("model_path", "")
    resolved = Path(model_path) if Path(model_path).is_absolute() else REPO_ROOT / model_path
    if args.model_path is None and not resolved.is_dir():
        print(f"inflight serve: no model at {resolved}. `make model` fetches the default one "
              f"(SmolLM2-135M-Instruct), `inflight make-model --out DIR` writes the small random "
              f"one of the tests; or pass --model-path DIR.", file=sys.stderr)
        return 2
    if args.model_path is not None and not Path(args.model_path).is_dir():
        print(f"inflight serve: --model-path {args.model_path} is not a folder", file=sys.stderr)
        return 2

    if args.api_key:
        from openai_server.auth import check_key
        try:
            args.api_key = [check_key(k, "--api-key") for k in args.api_key]
        except ValueError as exc:
            print(f"inflight serve: {exc}", file=sys.stderr)
            return 2
    server = TritonServer(repository, params=params, model_path=args.model_path, host=args.host,
                          http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, log_verbose=args.log_verbose,
                          log_to_console=True, extra_args=tuple(args.triton_arg))
    # -- the OpenAI-compatible server beside it (openai_server; --openai-port 0: none) --
    openai_api = None
    if args.openai_port:
        openai_api = OpenAIServer(server.grpc_url, Path(args.model_path).resolve() if args.model_path else resolved,
                                  host=args.host, port=args.openai_port, log_to_console=True,
                                  tool_call_parser=args.tool_call_parser, metrics_url=server.metrics_url,
                                  reasoning_parser=args.reasoning_parser, api_keys=tuple(args.api_key),
                                  extra_args=openai_flags(args))

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if openai_api is not None:
            openai_api.check_port()  # before the model loads, not after
        server.start()
        server.wait_ready(args.ready_timeout)
        for note in server.recoveries:  # a start that Triton's Python backend hung, ended and retried
            print(f"inflight serve: {note}", file=sys.stderr)
        if openai_api is not None:
            openai_api.start()
        _print_usage(server, openai_api)
        return _supervise(server, args)
    except ServerError as exc:
        print(f"inflight serve: {exc}", file=sys.stderr)
        return 1
    except OpenAIServerError as exc:
        print(f"inflight serve: {exc} (--openai-port 0 serves without it)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninflight serve: stopping", file=sys.stderr)
        return 0
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        if openai_api is not None:  # first: its clients' requests are cancelled, not cut off
            openai_api.stop()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def lora_params(entries: list[str], params: dict[str, str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... -> the config parameters: lora_modules as JSON with absolute
    folders (the server runs elsewhere), and enable_lora on."""
    import json

    from backend.core.lora import parse_lora_modules

    modules = parse_lora_modules(params.get("lora_modules"))
    modules.update({name: str(Path(path).expanduser().resolve()) for name, path in parse_lora_modules(entries).items()})
    return {"enable_lora": "true", "lora_modules": json.dumps(modules)}


def _print_usage(server, openai_api=None) -> None:
    host = "localhost" if server.host in ("0.0.0.0", "127.0.0.1", "") else server.host
    http, grpc = f"{host}:{server.http_port}", f"{host}:{server.grpc_port}"
    body = '{"text_input": "Once upon a time", "max_tokens": 32}'
    stream_body = '{"text_input": "Once upon a time", "max_tokens": 32, "stream": true}'
    openai_lines = ""
    if openai_api is not None:
        api = f"http://{host}:{openai_api.port}/v1"
        chat = '{"model": "llm", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
        openai_lines = (f"  OpenAI   {api}   (chat/completions, completions, models)\n"
                        f"                        curl -s {api}/chat/completions -H 'Content-Type: application/json' -d '{chat}'\n"
                        f"           {api[:-3]}/metrics   (the inference gateway's metrics, docs/gateway.md)\n")
    print(f"""
inflight: model 'llm' is ready.
  gRPC     {grpc}     inflight generate "Once upon a time" --stream --url {grpc}
  HTTP     {http}     curl -s {http}/v2/models/llm/generate -d '{body}'
                        curl -sN {http}/v2/models/llm/generate_stream -d '{stream_body}'
                        (HTTP `infer` refuses decoupled models: use generate / generate_stream)
{openai_lines}  metrics  http://{host}:{server.metrics_port}/metrics   (inflight_* beside Triton's own)
Ctrl-C stops the server.
""", flush=True)


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


def openai_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """`inflight serve`'s flags that `python -m openai_server` takes as they are."""
    flags = ["--api-key-all-routes"] if args.api_key_all_routes else []
    if getattr(args, "enable_runtime_lora", False):
        flags.append("--enable-runtime-lora")
    for name in ("max_chat_messages", "max_chat_rendered_chars", "allowed_local_media_path", "media_fetch_timeout"):
        if getattr(args, name, None) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if getattr(args, "allowed_media_domains", None):
        flags += ["--allowed-media-domains", *args.allowed_media_domains]
    return tuple(flags)


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
    return {"config": _config, "serve": _serve, "generate": _generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
