"""client/tools/benchmarks/host_step.py, the command behind performance.md's issue-42 host times, on
the tiny model: the engine thread's step (core_step) detokenizes nothing while the offline step()
does, the stubbed model computes nothing, and each batch size is timed."""
import torch

from client.tools.benchmarks import host_step


def test_the_engine_threads_step_makes_no_text_and_the_offline_step_does(default_model_dir):
    rows = host_step.measure_steps(str(default_model_dir), [1, 3], steps=4)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["engine_has_core_step"] and r["engine_ms"] > 0 and r["step_ms"] > 0
        assert r["engine_detok_ms"] == 0.0 < r["step_detok_ms"]


def test_the_stub_leaves_the_model_out(default_model_dir):
    llm, engine = host_step._decoding_engine(str(default_model_dir), 2, 4)
    host_step._stub_model(engine, 16)
    hidden = engine.runner.model.forward(torch.zeros(3, dtype=torch.long), None, None, None)
    assert hidden.abs().sum() == 0 and hidden.shape == (3, engine.model_config.hidden_size)
    outs = engine.step()
    assert len(outs) == 2 and all(len(o.new_token_ids) == 1 for o in outs)
    llm.close()
