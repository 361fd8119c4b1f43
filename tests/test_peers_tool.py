"""The peer comparison's driver (python -m client.tools.peers): its prompt-processing runs
(--prompt-lens) and the warm-up requests every runner sends before the clock starts."""
import json

from client.tools.peers import __main__ as peers
from client.tools.peers.common import warmup_items, write_result


def test_warmup_prompts_share_no_prefix_with_the_timed_ones():
    """A prefix cache would skip the prefill of a timed prompt the warm-up already sent, which
    would inflate a prompt-processing figure; rotated prompts start with another token."""
    items = [([5, 6, 7, 8], 30), ([9, 10, 11], 2), ([12, 13], 9)]
    warm = warmup_items(items, 2)
    assert warm == [([6, 7, 8, 5], 4), ([10, 11, 9], 4)]
    assert all(w[0][0] != p[0] for w, (p, _) in zip(warm, items))
    assert warmup_items(items, 9) == warmup_items(items, 3)  # no more than the workload has


def test_the_result_holds_the_prompt_rate_and_the_engines_own_figures(tmp_path):
    items = [([5, 6, 7], 1), ([8], 1)]
    write_result(tmp_path / "r.json", "x", 0.5, [1, 1], items, extra={"server_prompt_tok_s": 9.5})
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["prompt_tok_s"] == 8.0 and result["output_tok_s"] == 4.0
    assert result["server_prompt_tok_s"] == 9.5


def test_prompt_lens_run_fixed_prompts_of_one_output_token_and_compare_prompt_rates(
        tmp_path, monkeypatch, capsys):
    """--prompt-lens 40,97: one run per length, every prompt exactly that long asking for
    --output-len tokens, engines in alternating order per round, ratios of prompt tok/s."""
    from hf_checkpoints import make_checkpoint
    model = make_checkpoint("llama", tmp_path / "m")
    seen, speed = [], {"a": 2.0, "b": 1.0}  # prompt tokens per second of each stand-in engine

    def fake_engine(engine, args, model_path, workload, tmp):
        items = json.loads(workload.read_text())
        seen.append((engine, [len(r["input_ids"]) for r in items], [r["max_tokens"] for r in items]))
        prompt = sum(len(r["input_ids"]) for r in items)
        elapsed = prompt / (1000 * speed[engine])
        return {"engine": engine, "output_tok_s": 5.0, "prompt_tok_s": prompt / elapsed,  # output rates tie
                "peak_rss_mb": 1.0}

    monkeypatch.setattr(peers, "run_engine", fake_engine)
    monkeypatch.setitem(peers.ENGINES, "a", (None, "x", "model"))
    monkeypatch.setitem(peers.ENGINES, "b", (None, "x", "model"))
    out = tmp_path / "report.json"
    assert peers.main(["--model-path", str(model), "--engines", "a,b", "--prompt-lens", "40,97",
                       "--num-requests", "3", "--repeats", "2", "--output-json", str(out)]) == 0
    assert [e for e, _, _ in seen] == ["a", "b", "b", "a"] * 2
    assert [lens for _, lens, _ in seen] == [[40] * 3] * 4 + [[97] * 3] * 4
    assert all(outs == [1, 1, 1] for _, _, outs in seen)
    report = json.loads(out.read_text())
    assert [case["prompt_len"] for case in report] == [40, 97]
    first, second = report[0]["results"]
    assert first["prompt_tok_s"] == 2000.0 and second["prompt_tok_s"] == 1000.0
    assert second["ratio_of_first"] == [2.0, 2.0]
    assert "(prompt_tok_s): 2.00x, 2.00x" in capsys.readouterr().out


def test_a_killed_llamacpp_runner_takes_its_server_with_it(tmp_path):
    """The llama.cpp runner starts llama-server in a session of its own; when the runner dies (here
    SIGKILL: no finally runs) the server goes too. Before, a stopped table left a spinning server."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "server.pid"
    fake = tmp_path / "llama-server"  # never answers /health: the runner waits on it
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    fake.chmod(0o755)
    workload = tmp_path / "w.json"
    workload.write_text('[{"input_ids": [1, 2, 3], "max_tokens": 2}]')
    env = {**os.environ, "LLAMACPP_GGUF": str(tmp_path / "m.gguf"), "LLAMACPP_SERVER": str(fake), "LLAMACPP_THREADS": "1"}
    runner = subprocess.Popen([sys.executable, "-m", "client.tools.peers.run_llamacpp", "--model-path", str(tmp_path),
                               "--workload", str(workload), "--out", str(tmp_path / "out.json")], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        server = int(pidfile.read_text())
        os.kill(server, 0)  # running
        runner.send_signal(signal.SIGKILL)
        runner.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                break
            if open(f"/proc/{server}/stat").read().split(") ")[1].startswith("Z"):
                break  # gone, not yet reaped by init
            time.sleep(0.1)
        else:
            os.killpg(server, signal.SIGKILL)
            raise AssertionError("llama-server outlived its runner")
    finally:
        if runner.poll() is None:
            runner.kill()
