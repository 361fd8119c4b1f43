"""client.tools.benchmarks.chunk_price: each measured step carries exactly one chunk of the asked
size beside the decode rows, at the asked position (the engine's own step shapes say so), and the
report has a cell per (start, chunk)."""
import pytest

from backend.sched import step_cost
from client.tools.benchmarks import chunk_price


def test_each_timed_step_carries_one_chunk_of_the_asked_size_at_its_start(default_model_dir, monkeypatch):
    shapes = []
    real = step_cost.batch_shape

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
    assert [c["end"] for c in res["cells"]] == [39, 47, 72, 80]  # where the timed chunks lie


@pytest.mark.slow  # builds every kernel library it loads from the copy: ~4 s of CPU
def test_csrc_builds_the_kernels_from_another_folder(default_model_dir, monkeypatch, tmp_path, capsys):
    """--csrc (an A/B against another commit's kernels): every kernel the run builds comes from that
    folder (a copy of this tree's, one comment apart, so its libraries are new ones)."""
    import shutil

    from kernels.cpu import build as cpu_build
    for f in cpu_build.CSRC.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "prefill_attention.c").write_text((tmp_path / "prefill_attention.c").read_text() + "/* a copy */\n")
    monkeypatch.setattr(cpu_build, "CSRC", cpu_build.CSRC)  # restored after the test
    seen, real = [], cpu_build.build
    monkeypatch.setattr(cpu_build, "build", lambda name, isa=None: (seen.append((name, cpu_build.CSRC)), real(name, isa))[1])
    cpu_build.load.cache_clear(), cpu_build.function.cache_clear()
    try:
        assert chunk_price.main(["--model-path", str(default_model_dir), "--csrc", str(tmp_path), "--rows", "1",
                                 "--chunks", "3", "--starts", "37", "--steps", "1"]) == 0
    finally:
        cpu_build.load.cache_clear(), cpu_build.function.cache_clear()
    assert ("prefill_attention", tmp_path) in seen and all(where == tmp_path for _, where in seen)
    assert "| 37 | 3 | 37-40 |" in capsys.readouterr().out
