"""`make bench-peers` says what it ran on (client/tools/peers/machine.py): the CPU model and the ISA
flags of a cpuinfo file, inflight's packed-GEMM build, and the x86 options of llama.cpp's build as its
CMakeCache.txt holds them; printed above the figures and written into every case of the JSON."""
import json

from client.tools.peers import __main__ as peers
from client.tools.peers.machine import describe, machine_report
from kernels.cpu import quant as cpu_quant
ZEN3 = ("processor\t: 0\nmodel name\t: AMD EPYC 7763 64-Core Processor\n"
        "flags\t\t: fpu sse2 ssse3 sse4_2 avx fma f16c bmi2 avx2\n\nprocessor\t: 1\n")
CACHE = ("// a cmake cache\nGGML_NATIVE:BOOL=OFF\nGGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL=OFF\n"
         "GGML_AVX512_VNNI:BOOL=OFF\nGGML_AMX_INT8:BOOL=OFF\nGGML_CUDA:BOOL=OFF\nGGML_OPENMP:BOOL=ON\n")


def llama_build(tmp_path, cache=CACHE):
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "CMakeCache.txt").write_text(cache)
    return tmp_path / "build" / "bin" / "llama-server"


def test_an_avx2_only_machine_and_its_llamacpp_build(tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text(ZEN3)
    monkeypatch.setattr(cpu_quant, "chosen_isa", lambda: "avx2")
    report = machine_report(llama_build(tmp_path), tmp_path / "cpuinfo")
    assert report["cpu_model"] == "AMD EPYC 7763 64-Core Processor"
    assert [f for f, on in report["isa_flags"].items() if on] == ["avx2", "fma", "f16c"]
    assert report["isa_flags"]["avx512f"] is False and report["isa_flags"]["amx_int8"] is False
    assert report["inflight_quant_build"] == "avx2"
    # the x86 options only, as cmake stored them
    assert report["llamacpp_build"] == {"NATIVE": "OFF", "AVX2": "ON", "AVX512": "OFF", "AVX512_VNNI": "OFF",
                                        "AMX_INT8": "OFF"}
    text = describe(report)
    assert text.startswith("CPU: AMD EPYC 7763 64-Core Processor; lists avx2 fma f16c; not avx512f avx512bw ")
    assert "inflight's packed GEMM: the avx2 build; llama.cpp built with NATIVE=OFF AVX2=ON AVX512=OFF" in text


def test_no_cpuinfo_and_no_llamacpp_build_say_so(tmp_path):
    report = machine_report(tmp_path / "nothing" / "bin" / "llama-server", tmp_path / "no-cpuinfo")
    assert report["cpu_model"] == "unknown" and not any(report["isa_flags"].values())
    assert report["llamacpp_build"] is None and report["inflight_quant_build"] == cpu_quant.chosen_isa()
    assert "lists none of avx2 fma" in describe(report) and "llama.cpp built with no build found" in describe(report)


def test_the_comparison_prints_and_records_the_machine(tmp_path, default_model_dir, capsys):
    out = tmp_path / "peers.json"
    # llamacpp without --gguf fails at once: the machine is still printed and recorded
    code = peers.main(["--model-path", str(default_model_dir), "--engines", "llamacpp", "--num-requests", "2",
                       "--llama-server", str(llama_build(tmp_path)), "--output-json", str(out)])
    assert code == 1
    printed = capsys.readouterr().out
    assert printed.startswith("CPU: ") and f"the {cpu_quant.chosen_isa()} build; llama.cpp built with NATIVE=OFF" in printed
    case = json.loads(out.read_text())[0]
    assert case["machine"]["llamacpp_build"]["AVX2"] == "ON" and set(case["machine"]) == {
        "cpu_model", "isa_flags", "inflight_quant_build", "llamacpp_build"}
