"""client.tools.benchmarks.chunk_price: each measured step carries exactly one chunk of the asked
size beside the decode rows, at the asked position (the engine's own step shapes say so), and the
report has a cell per (start, chunk)."""
from backend.sched import pacing
from client.tools.benchmarks import chunk_price


def test_each_timed_step_carries_one_chunk_of_the_asked_size_at_its_start(default_model_dir, monkeypatch):
    shapes = []
    real = pacing.batch_shape

    def spy(batch):
        shapes.append([(s.start, s.num_new_tokens) for s in batch.prefills + batch.decodes  # (a 1-token chunk: a decode row)
                       if s.start < s.request.num_prompt_tokens - 1])
        return real(batch)

    monkeypatch.setattr("backend.engine.core.batch_shape", spy)
    res = chunk_price.measure(str(default_model_dir), rows=3, chunks=[1, 5], starts=[37, 70], steps=2)
    assert [(c["start"], c["chunk"]) for c in res["cells"]] == [(37, 1), (37, 5), (70, 1), (70, 5)]
    assert all(c["cpu_ms"] > 0 and c["wall_ms"] > 0 for c in res["cells"]) and res["decode_cpu_ms"] > 0
    for start, chunk in [(37, 1), (37, 5), (70, 1), (70, 5)]:  # the timed steps, in order
        timed = [(start + i * chunk, chunk) for i in range(2)]
        assert any(shapes[i:i + 2] == [[t] for t in timed] for i in range(len(shapes))), (start, chunk)
