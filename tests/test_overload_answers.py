"""How each door answers an overload refusal (docs/configuration.md, "Overload told early"): the
engine's QueueFullError / TTFTTargetError message ends "retry after N s"; the Triton adapter
answers it UNAVAILABLE with that message; the OpenAI server reads it back into a 429 with a
Retry-After header. (Served end to end: tests/e2e/test_overload.py.)"""
import json
import sys
from pathlib import Path

from backend.core.errors import EngineDeadError, QueueFullError, TTFTTargetError
from openai_server.app import _error
from openai_server.translate import APIError
from openai_server.triton_backend import error_status

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "1"))
from triton_errors import error_for  # noqa: E402


def test_a_refusal_is_unavailable_on_triton_with_the_figure_in_its_message():
    for exc in (QueueFullError("queue full: 3 requests are waiting (max_queue_size)", 4.2),
                TTFTTargetError("the queue cannot meet the time-to-first-token target", 0.3)):
        err = error_for(exc)
        assert err.code == "UNAVAILABLE" and str(err).endswith(f"retry after {exc.retry_after} s")


def test_the_openai_port_answers_429_with_retry_after():
    for message, seconds in (("queue full: 3 requests are waiting (max_queue_size); retry after 5 s", "5"),
                             ("the queue cannot meet the time-to-first-token target: expected 9.00 s, target "
                              "1 s (ttft_target_ms); retry after 8 s", "8")):
        status = error_status(message)
        assert status == 429
        response = _error(APIError(status, message, code="triton_error"))
        assert response.status_code == 429 and response.headers["retry-after"] == seconds
        assert json.loads(response.body)["error"]["type"] == "rate_limit_error"
    dead = _error(APIError(error_status(str(EngineDeadError("the engine is shut down"))), "the engine is shut down"))
    assert dead.status_code == 503 and "retry-after" not in dead.headers
    bad = _error(APIError(400, "max_tokens: retry after 3 s is not a number"))  # only overloads get the header
    assert "retry-after" not in bad.headers


def test_queue_info_carries_the_expected_wait():
    from backend.core.outputs import QueueInfo
    from client.protocol import _queue
    from triton_outputs import queue_tensors

    waiting = QueueInfo(engine_step=4, position=1, reserved_step=None, first_scheduled_step=None,
                        kv_blocks_reserved=0, arrival_time=0.0, first_scheduled_time=None, first_token_time=None,
                        finished_time=None, expected_wait_seconds=2.5)
    tensors = queue_tensors(waiting)
    assert tensors["expected_wait_seconds"].dtype.name == "float64" and tensors["expected_wait_seconds"][0] == 2.5
    assert _queue({k: list(v) for k, v in tensors.items()})["expected_wait_seconds"] == 2.5
    waiting.expected_wait_seconds = None  # before the engine has measured a step
    assert queue_tensors(waiting)["expected_wait_seconds"][0] == -1.0
