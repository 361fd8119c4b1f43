"""The peer table's forced AVX2 build (engine `inflight-avx2`) stands for an AVX2-only CPU: besides our
kernels' AVX2 builds it must cap oneDNN (float and bfloat16 layers: AVX-512 or AMX otherwise) and
torch's own vectorized ops. Noticed in issue 47: with INFLIGHT_CPU_ISA alone the float rows of the
forced AVX2 build kept oneDNN's AVX-512/AMX GEMMs and overstated an AVX2 machine."""
import json
import subprocess
import sys
from types import SimpleNamespace

from client.tools.peers import __main__ as peers_main


def test_the_forced_avx2_engine_gets_every_cap(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(env)
        out = cmd[cmd.index("--out") + 1]
        with open(out, "w") as f:
            json.dump({"engine": "inflight"}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(peers_main.subprocess, "run", fake_run)
    args = SimpleNamespace(inflight_threads=2, float_model_path=None, gguf=None, concurrency=1)
    peers_main.run_engine("inflight-avx2", args, str(tmp_path), tmp_path / "w.json", tmp_path)
    assert {k: seen.get(k) for k in peers_main.AVX2_ONLY} == peers_main.AVX2_ONLY
    seen.clear()
    peers_main.run_engine("inflight", args, str(tmp_path), tmp_path / "w.json", tmp_path)
    assert not any(k in seen and seen[k] == v for k, v in peers_main.AVX2_ONLY.items())


def test_the_caps_take_effect_in_a_child():
    """In a process started with them, torch dispatches its ops at AVX2 at most and oneDNN runs no
    AMX, whatever this CPU has."""
    code = ("import torch; from kernels.cpu import onednn; "
            "print(torch.backends.cpu.get_cpu_capability(), onednn.runs_amx_bf16(), onednn.runs_fp16())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**peers_main.os.environ, **peers_main.AVX2_ONLY})
    assert done.returncode == 0, done.stderr[-500:]
    capability, amx, fp16 = done.stdout.split()
    assert capability in ("AVX2", "DEFAULT") and amx == "False" and fp16 == "False"
