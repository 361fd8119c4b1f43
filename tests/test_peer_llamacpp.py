"""The llama.cpp peer runner (client/tools/peers/run_llamacpp.py) against a stand-in llama-server
(the real one is built outside the repository by `make peers-llamacpp`): requests go out as token
ids with greedy sampling and ignore_eos, all at once or one at a time in the workload's order; and
the instruction sets `make peers-llamacpp` builds llama.cpp for, read from the machine's cpuinfo."""
import json
import threading
import time

from client.tools.peers import run_llamacpp
from loopback_http import Quiet, serving


class FakeServer(Quiet):
    log: list = []
    active = 0
    most_active = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with FakeServer.lock:
            FakeServer.active += 1
            FakeServer.most_active = max(FakeServer.most_active, FakeServer.active)
            FakeServer.log.append(body)
        time.sleep(0.05)
        with FakeServer.lock:
            FakeServer.active -= 1
        self.send_body(json.dumps({"tokens_predicted": body["n_predict"],
                                   "timings": {"prompt_per_second": 100.0 * len(body["prompt"])}}).encode())


def serve():
    FakeServer.log, FakeServer.active, FakeServer.most_active = [], 0, 0
    return serving(FakeServer)


def test_requests_are_token_ids_greedy_ignore_eos_and_concurrent():
    items = [([1, 2, 3], 5), ([4], 2), ([5, 6], 7), ([7, 8, 9, 10], 1)]
    with serve() as (_, port):
        replies = run_llamacpp.run(port, items, 0)
    assert sorted((b["prompt"], b["n_predict"]) for b in FakeServer.log) == sorted(items)
    assert all(b["temperature"] == 0 and b["top_k"] == 1 and b["ignore_eos"] and not b["cache_prompt"]
               for b in FakeServer.log)
    assert FakeServer.most_active > 1
    assert [r["tokens_predicted"] for r in replies] == [5, 2, 7, 1]  # in the workload's order
    # the server's own prefill rate: the median over requests (here 100/s per prompt token)
    assert run_llamacpp.server_prompt_rate(replies) == {"server_prompt_tok_s": 300.0}
    assert run_llamacpp.server_prompt_rate([{"tokens_predicted": 1}]) == {}


def test_concurrency_one_sends_them_in_turn_in_order():
    items = [([i], i + 1) for i in range(5)]
    with serve() as (_, port):
        run_llamacpp.run(port, items, 1)
    assert [b["prompt"] for b in FakeServer.log] == [[i] for i in range(5)]
    assert FakeServer.most_active == 1


def llamacpp_cmake_flags(tmp_path, cpu_flags: str) -> dict[str, str]:
    """The -DGGML_* options `make peers-llamacpp` passes to cmake on a machine whose /proc/cpuinfo
    lists ``cpu_flags`` (make -n: printed, not run)."""
    import re
    import subprocess
    from pathlib import Path

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {cpu_flags}\n\nprocessor\t: 1\nflags\t\t: {cpu_flags}\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["make", "-n", "-s", "-C", str(root), "peers-llamacpp", f"CPUINFO={cpuinfo}",
                           f"PEERS_DIR={tmp_path / 'peers'}"], capture_output=True, text=True, check=True)
    return dict(re.findall(r"-DGGML_(\w+)=(\w+)", done.stdout))


AVX2_ONLY = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c bmi1 bmi2 avx2"


def test_llamacpp_build_on_an_avx2_only_machine_asks_for_no_avx512(tmp_path):
    flags = llamacpp_cmake_flags(tmp_path, AVX2_ONLY)
    assert flags["NATIVE"] == "OFF"
    assert {k: flags[k] for k in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "SSE42")} == dict.fromkeys(
        ("AVX", "AVX2", "FMA", "F16C", "BMI2", "SSE42"), "ON")
    assert {k: flags[k] for k in ("AVX512", "AVX512_VNNI", "AVX512_BF16")} == dict.fromkeys(
        ("AVX512", "AVX512_VNNI", "AVX512_BF16"), "OFF")


def test_llamacpp_build_uses_the_avx512_a_machine_lists_and_never_amx(tmp_path):
    flags = llamacpp_cmake_flags(tmp_path, AVX2_ONLY + " avx512f avx512bw avx512vl avx512_vnni amx_tile amx_int8 amx_bf16")
    assert flags["AVX512"] == flags["AVX512_VNNI"] == "ON"
    assert flags["AVX512_BF16"] == "OFF"  # not listed here
    assert flags["AMX_TILE"] == flags["AMX_INT8"] == flags["AMX_BF16"] == "OFF"
