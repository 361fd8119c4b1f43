"""Liveness: one real 1-token generate through the HTTP endpoint; exit 0 when it answers with text.

The Docker HEALTHCHECK and the Kubernetes liveness probe run it. Readiness (`/v2/health/ready`)
is not enough for liveness: Triton keeps reporting a model ready while its Python stub or engine
thread is dead, and only a request that goes through the engine shows that.

    python3 healthcheck.py [--url http://127.0.0.1:8000] [--timeout 10]

Standard library only, so it runs in any image that has Python.
"""
import argparse
import json
import sys
import urllib.error
import urllib.request


def check(url: str, timeout: float) -> str:
    """'' when a 1-token generate succeeds; otherwise why not."""
    body = json.dumps({"text_input": "hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/v2/models/llm/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read().decode())
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}"
    except (OSError, ValueError) as exc:  # refused, timed out, not JSON
        return f"{type(exc).__name__}: {exc}"
    if "text_output" not in answer:
        return f"no text_output in the answer: {str(answer)[:200]}"
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Triton's HTTP endpoint")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    problem = check(args.url, args.timeout)
    if problem:
        print(f"inflight healthcheck: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
