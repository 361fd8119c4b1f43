"""Issue 47's peer table (python -m client.tools.peers table, client/tools/peers/table.py): its columns'
workloads, the interleaved rounds per cell, the ratios (inflight over llama.cpp; llama.cpp's time to
first token over inflight's), both inflight builds on an AVX-512 CPU, the JSON with the machine and
the load, and the PNG beside it; the runners' per-request timing (time to first token, decode rate
after it) that the prompt and decode columns compare."""
import json
from types import SimpleNamespace

import pytest
from PIL import Image

from client.tools.peers import __main__ as peers
from client.tools.peers import run_inflight, run_llamacpp, table, table_rows

AVX512 = {"cpu_model": "Test CPU", "isa_flags": {"avx2": True, "avx512f": True}, "inflight_quant_build": "avx512_vnni",
          "llamacpp_build": {"AVX512": "ON"}}
AVX2 = {**AVX512, "isa_flags": {"avx2": True, "avx512f": False}}


def test_smoke_sizes_and_refusals():
    args = table.parse(["--smoke", "--decode-tokens", "16"])
    assert (args.single_requests, args.batch_requests, args.prompt_lens, args.decode_context) == (2, 4, [64, 128], 256)
    assert args.decode_tokens == 16  # a later flag wins over --smoke's
    full = table.parse([])
    assert (full.batch_requests, full.prompt_lens, full.decode_context, full.rows) == (32, [512, 4096], 8192, list(table_rows.ROWS))
    with pytest.raises(SystemExit, match=r"unknown --rows \['llama7b'\]"):
        table.parse(["--rows", "smollm2-q4_1,llama7b"])
    with pytest.raises(SystemExit, match="--decode-tokens 300 must be in 1..--decode-context - 1"):
        table.parse(["--decode-context", "300", "--decode-tokens", "300"])


def test_both_builds_where_the_cpu_lists_avx512():
    assert table.engines_for(AVX512, "auto") == ["inflight", "inflight-avx2", "llamacpp"]
    assert table.engines_for(AVX2, "auto") == ["inflight", "llamacpp"]
    assert table.engines_for(AVX2, "both") == ["inflight", "inflight-avx2", "llamacpp"]
    assert table.engines_for(AVX512, "native") == ["inflight", "llamacpp"]
    # llama.cpp's AVX2 build, where there is one, runs beside the AVX2 inflight and is its peer
    both = table.engines_for(AVX512, "auto", avx2_peer=True)
    assert both == ["inflight", "inflight-avx2", "llamacpp", "llamacpp-avx2"]
    assert table.peers_of(both) == {"inflight": "llamacpp", "inflight-avx2": "llamacpp-avx2"}
    assert table.engines_for(AVX512, "native", avx2_peer=True) == ["inflight", "llamacpp"]
    assert table.peers_of(table.engines_for(AVX512, "auto")) == {"inflight": "llamacpp", "inflight-avx2": "llamacpp"}


def test_each_llamacpp_engine_runs_its_own_build(tmp_path, monkeypatch):
    """llamacpp and llamacpp-avx2 start the llama-server of their own build folders (or the flags')."""
    seen = []

    def fake_run(cmd, env, **kw):
        seen.append(env["LLAMACPP_SERVER"])
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump({"engine": "llamacpp"}, f)
        return peers.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    for folder in ("llama.cpp-build", "llama.cpp-build-avx2"):
        (tmp_path / folder / "bin").mkdir(parents=True)
        (tmp_path / folder / "bin" / "llama-server").touch()
    args = table.parse(["--peers-dir", str(tmp_path)])
    ns = SimpleNamespace(inflight_threads=2, float_model_path=None, gguf=tmp_path / "x.gguf", concurrency=1,
                         peers_dir=tmp_path, llama_server=args.llama_server, llama_server_avx2=args.llama_server_avx2)
    for engine in ("llamacpp", "llamacpp-avx2"):
        peers.run_engine(engine, ns, str(tmp_path), tmp_path / "w.json", tmp_path)
    assert seen == [str(tmp_path / "llama.cpp-build" / "bin" / "llama-server"),
                    str(tmp_path / "llama.cpp-build-avx2" / "bin" / "llama-server")]
    missing = peers.run_engine("llamacpp-avx2", SimpleNamespace(**{**vars(ns), "llama_server_avx2": tmp_path / "none"}),
                               str(tmp_path), tmp_path / "w.json", tmp_path)
    assert "make peers-llamacpp-avx2 builds it" in missing["error"]


def test_the_columns_workloads():
    args = table.parse(["--single-requests", "3", "--batch-requests", "5", "--prompt-lens", "40,97",
                        "--prompt-requests", "2", "--decode-context", "300", "--decode-tokens", "20"])
    single, c1, k1 = table.cell_workload("single", args, 1000)
    batch, c0, k0 = table.cell_workload("batch32", args, 1000)
    assert (len(single), c1, k1, len(batch), c0, k0) == (3, 1, "output_tok_s", 5, 0, "output_tok_s")
    for column, length in (("prompt_short", 40), ("prompt_long", 97)):
        items, conc, key = table.cell_workload(column, args, 1000)
        assert [(len(w.prompt), w.max_tokens) for w in items] == [(length, 1)] * 2 and (conc, key) == (1, "ttft_s")
    items, conc, key = table.cell_workload("decode_ctx", args, 1000)
    assert [(len(w.prompt), w.max_tokens) for w in items] == [(280, 20)] and (conc, key) == (1, "decode_tok_s")


def test_the_table_runs_every_cell_interleaved_and_writes_json_and_png(tmp_path, monkeypatch, capsys, default_model_dir):
    """Stand-in engines of known speed: inflight 3x llama.cpp's output rate and decode rate, its
    TTFT a quarter of llama.cpp's; the AVX2 build half as fast. Rows without a target skip a cell."""
    calls = []
    speed = {"inflight": 3.0, "inflight-avx2": 1.5, "llamacpp": 1.0}

    def fake_engine(engine, ns, model_path, workload, tmp):
        items = json.loads(workload.read_text())
        calls.append((engine, ns.concurrency, len(items), str(ns.gguf)))
        return {"engine": engine, "output_tok_s": 10 * speed[engine], "prompt_tok_s": 100 * speed[engine],
                "ttft_s": 0.4 / (speed[engine] + (engine != "llamacpp")), "decode_tok_s": 7 * speed[engine]}

    gguf = tmp_path / "x.gguf"
    monkeypatch.setattr(peers, "run_engine", fake_engine)
    monkeypatch.setattr(table_rows, "row_files", lambda names, work, cache: {n: gguf for n in names})
    monkeypatch.setattr(table_rows, "imported", lambda g, work: default_model_dir)
    monkeypatch.setattr("client.tools.peers.machine.machine_report", lambda server: AVX512)
    out = tmp_path / "t.json"
    code = table.main(["--rows", "smollm2-q4_1,smollm2-f16", "--smoke", "--repeats", "2", "--output-json", str(out),
                       "--peers-dir", str(tmp_path)])  # (no llama.cpp AVX2 build there, whatever this machine has)
    assert code == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_model"] == "Test CPU" and report["engines"] == ["inflight", "inflight-avx2", "llamacpp"]
    assert report["smoke"] and report["sizes"]["prompt_lens"] == [64, 128]
    q4, f16 = report["rows"]
    assert [c["column"] for c in q4["cells"]] == list(table_rows.COLUMNS)
    assert [c["column"] for c in f16["cells"]] == ["single", "batch32", "prompt_short", "prompt_long"]  # no decode target
    # per cell: round 1 in order, round 2 reversed
    per_cell = [e for e, *_ in calls]
    assert per_cell[:6] == ["inflight", "inflight-avx2", "llamacpp", "llamacpp", "inflight-avx2", "inflight"]
    assert len(calls) == 6 * (5 + 4) and {g for *_, g in calls} == {str(gguf)}
    cells = {c["column"]: c for c in q4["cells"]}
    assert cells["single"]["ratios"] == {"inflight": [3.0, 3.0], "inflight-avx2": [1.5, 1.5]}
    assert cells["decode_ctx"]["ratios"]["inflight"] == [3.0, 3.0]
    assert cells["prompt_long"]["ratios"]["inflight"] == [pytest.approx(4.0)] * 2  # llama.cpp's TTFT over inflight's
    assert cells["prompt_long"]["median"]["inflight-avx2"] == pytest.approx(2.5)
    assert (cells["single"]["target"], cells["batch32"]["target"], cells["decode_ctx"]["target"]) == (2, 4, 2)
    assert [c["concurrency"] for c in q4["cells"]] == [1, 0, 1, 1, 1]
    assert all(len(c["loadavg_before"]) == 3 and c["started"] <= c["finished"] for c in q4["cells"])
    png = out.with_suffix(".png")
    assert Image.open(png).size[0] > 500
    printed = capsys.readouterr().out
    assert "inflight/llamacpp 3.00x, 3.00x" in printed and "target >= 4x" in printed


def test_a_failed_engine_is_reported_and_fails_the_run(tmp_path, monkeypatch, default_model_dir):
    def fake_engine(engine, ns, model_path, workload, tmp):
        if engine == "llamacpp":
            return {"engine": engine, "error": "exit 1:\nllama-server exited"}
        return {"engine": engine, "output_tok_s": 5.0, "prompt_tok_s": 5.0, "ttft_s": 0.1, "decode_tok_s": 5.0}

    monkeypatch.setattr(peers, "run_engine", fake_engine)
    monkeypatch.setattr(table_rows, "row_files", lambda names, work, cache: {n: tmp_path / "x.gguf" for n in names})
    monkeypatch.setattr(table_rows, "imported", lambda g, work: default_model_dir)
    monkeypatch.setattr("client.tools.peers.machine.machine_report", lambda server: AVX2)
    out = tmp_path / "t.json"
    assert table.main(["--rows", "smollm2-q4_1", "--columns", "single", "--repeats", "1", "--output-json", str(out),
                       "--peers-dir", str(tmp_path)]) == 1
    cell = json.loads(out.read_text())["rows"][0]["cells"][0]
    assert cell["ratios"] == {"inflight": []} and cell["median"] == {"inflight": None}
    assert out.with_suffix(".png").is_file()


def test_inflight_times_each_request(default_model_dir):
    """timed_run: tokens per request in the workload's order, time to first token > 0, decode time
    over the tokens after the first (none for a one-token request)."""
    from backend import LLM, SamplingParams
    llm = LLM(str(default_model_dir), max_model_len=128, cpu_kv_cache_tokens=512)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    items = [([5, 6, 7, 8, 9], 6), (list(range(30, 70)), 1), ([11, 12], 3)]
    for concurrency in (1, 0):
        timed = run_inflight.timed_run(llm.engine, items, concurrency, greedy)
        assert [n for n, _, _ in timed] == [6, 1, 3]
        assert all(ttft > 0 for _, ttft, _ in timed) and timed[1][2] == 0 and timed[0][2] > 0
    figures = run_inflight.timing_figures([(6, 0.2, 0.5), (1, 0.4, 0.0), (3, 0.3, 1.0)])
    assert figures == {"ttft_s": 0.3, "decode_tok_s": 6.0}  # median of 5/0.5 and 2/1.0
    assert run_inflight.timing_figures([(1, 0.2, 0.0)])["decode_tok_s"] is None


def test_llamacpp_figures_are_its_own_timings():
    replies = [{"tokens_predicted": 9, "timings": {"prompt_per_second": 50.0, "prompt_ms": 800.0, "predicted_n": 9,
                                                   "predicted_per_second": 20.0}},
               {"tokens_predicted": 1, "timings": {"prompt_per_second": 70.0, "prompt_ms": 400.0, "predicted_n": 1,
                                                   "predicted_per_second": 0.0}}]
    assert run_llamacpp.server_prompt_rate(replies) == {"server_prompt_tok_s": 70.0, "ttft_s": 0.8, "decode_tok_s": 20.0}
    assert run_llamacpp.server_prompt_rate(replies[1:])["decode_tok_s"] is None


def test_the_png_title_wraps_a_long_flag_list(tmp_path, monkeypatch):
    """The machine line (CPU model, every ISA flag) is wrapped to the figure's width: a Xeon's 11 flags
    ran off both edges of a one-row figure."""
    import matplotlib.figure

    from client.tools.peers import table_plot

    titles = []
    real = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda fig, text, **kw: (titles.append((text, fig.get_figwidth())), real(fig, text, **kw))[1])
    flags = {f: True for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                               "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")}
    cell = {"column": "single", "target": 2, "ratios": {"inflight": [3.0, 3.1]}, "median": {"inflight": 3.05}}
    report = {"engines": ["inflight", "llamacpp"], "sizes": {}, "threads": 2, "started": "2026-12-04T10:33:38+00:00",
              "machine": {**AVX512, "cpu_model": "Intel(R) Xeon(R) Processor", "isa_flags": flags},
              "rows": [{"label": "SmolLM2-135M Q4_1", "cells": [cell]}]}
    table_plot.plot(report, tmp_path / "t.png")
    (text, width), = titles
    lines = text.split("\n")
    assert len(lines) > 1 and all(len(line) <= width * 14 for line in lines), lines
    assert " ".join(lines).split() == ("Intel(R) Xeon(R) Processor (" + " ".join(flags) + "); 2 threads; "
                                       "2026-12-04T10:33:38+00:00").split()


def test_the_avx2_build_is_compared_with_llamacpps_avx2_build(tmp_path, monkeypatch, capsys, default_model_dir):
    """With llama.cpp's AVX2 build present, it runs in every round and is inflight-avx2's peer; the
    ratio against llama.cpp's build for this CPU stays as cross_ratios."""
    speed = {"inflight": 3.0, "inflight-avx2": 1.5, "llamacpp": 1.0, "llamacpp-avx2": 0.6}
    calls = []

    def fake_engine(engine, ns, model_path, workload, tmp):
        calls.append(engine)
        return {"engine": engine, "output_tok_s": 10 * speed[engine], "prompt_tok_s": 100 * speed[engine],
                "ttft_s": 0.3 / speed[engine], "decode_tok_s": 7 * speed[engine]}

    server = tmp_path / "avx2" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.touch()
    (server.parent.parent / "CMakeCache.txt").write_text("GGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL=OFF\n")
    monkeypatch.setattr(peers, "run_engine", fake_engine)
    monkeypatch.setattr(table_rows, "row_files", lambda names, work, cache: {n: tmp_path / "x.gguf" for n in names})
    monkeypatch.setattr(table_rows, "imported", lambda g, work: default_model_dir)
    monkeypatch.setattr("client.tools.peers.machine.machine_report", lambda server: AVX512)
    out = tmp_path / "t.json"
    assert table.main(["--rows", "smollm2-q4_1", "--columns", "single,prompt_short", "--smoke", "--repeats", "2",
                       "--llama-server-avx2", str(server), "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engines"] == ["inflight", "inflight-avx2", "llamacpp", "llamacpp-avx2"]
    assert report["peers"] == {"inflight": "llamacpp", "inflight-avx2": "llamacpp-avx2"}
    assert report["machine"]["llamacpp_avx2_build"] == {"AVX2": "ON", "AVX512": "OFF"}
    assert "llamacpp_avx2_build" not in AVX512  # the stand-in machine report was not changed in place
    assert calls[:8] == ["inflight", "inflight-avx2", "llamacpp", "llamacpp-avx2"] * 1 + \
        ["llamacpp-avx2", "llamacpp", "inflight-avx2", "inflight"]
    single, prompt = report["rows"][0]["cells"]
    assert single["ratios"]["inflight"] == [pytest.approx(3.0)] * 2
    assert single["ratios"]["inflight-avx2"] == [pytest.approx(2.5)] * 2     # 1.5 over llama.cpp's AVX2 0.6
    assert single["cross_ratios"] == {"inflight-avx2": [pytest.approx(1.5)] * 2}
    assert prompt["median"]["inflight-avx2"] == pytest.approx(2.5)           # its TTFT against the AVX2 build's
    printed = capsys.readouterr().out
    assert "inflight-avx2/llamacpp-avx2 2.50x, 2.50x; inflight-avx2/llamacpp 1.50x, 1.50x" in printed
    assert "inflight-avx2's peer: llama.cpp built with AVX2=ON AVX512=OFF" in printed
