"""`inflight serve`: the rendered config checked, tritonserver started on a run copy of the model
repository and the OpenAI-compatible server beside it, the usage printed, then the watch that
starts tritonserver again when it or a model's stub dies (docs/reliability.md). client/cli.py
parses the flags.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from templates.render import stale_warning, tensor_parallel_problem

REPO_ROOT = Path(__file__).resolve().parents[1]


def supervise(server, args: argparse.Namespace) -> int:
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


def serve(args: argparse.Namespace) -> int:
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
        for note in server.recoveries:  # a start that Triton's Python backend hung or crashed, ended and retried
            print(f"inflight serve: {note}", file=sys.stderr)
        if openai_api is not None:
            openai_api.start()
        print_usage(server, openai_api)
        return supervise(server, args)
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


def print_usage(server, openai_api=None) -> None:
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
