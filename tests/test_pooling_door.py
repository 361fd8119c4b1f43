"""The `llm` model's pooling door (model_repository/llm/1/pooling_door.py, docs/pooling.md): a
refused pooling request is answered once with its error and leaves nothing behind in the adapter."""
import numpy as np

from test_triton_adapter import FakeEngine, FakeSender, Metrics, S, adapter, one, respond


def test_a_refused_pooling_request_leaves_no_live_request():
    """pooling_task to a generate model, and chat asked of a pooling model: one error response each,
    the adapter holds no request afterwards (a leftover one was later polled after its FINAL)."""
    engine = FakeEngine()
    frontend = adapter.Frontend(engine, respond, Metrics(), poll_interval=0.01)
    try:
        sender = FakeSender()
        frontend.submit("", {"text_input": S("hi"), "pooling_task": S("embed")}, sender)
        [(tensors, error, final)] = sender.responses
        assert final and tensors is None and "pooling_task: this model serves the generate runner" in str(error)
        engine.engine = type("Inner", (), {"pooling": type("P", (), {"task": "embed"})()})()  # now a pooling model
        sender = FakeSender()
        frontend.submit("", {"text_input": S("hi"), "max_tokens": one(4, np.int32)}, sender,
                        outputs=frozenset({"text_output"}))
        [(_, error, final)] = sender.responses
        assert final and "serves the pooling runner" in str(error)
        assert frontend.num_live() == 0
    finally:
        frontend.close(timeout=1)
