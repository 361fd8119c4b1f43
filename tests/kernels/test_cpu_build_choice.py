"""kernels/cpu/build.py's one choice of a kernel's build (`first_that_runs`, `forced_build`), which
quant.py's and float_gemm.py's `chosen_isa` both use: on a played CPU and played probes, no compiler."""
import pytest

from kernels.cpu import build as cpu_build

BUILDS = ("wide", "narrow", "plain", "portable")
NEEDS = {"wide": ("avx512f", "avx512bw"), "narrow": ("avx2", "fma"), "plain": ("sse4_2",)}


def _probes(results):
    """A probe that answers `results[build]` and records which builds it was asked about."""
    asked = []

    def probe(isa):
        asked.append(isa)
        return results[isa]
    return probe, asked


def test_the_first_listed_build_whose_probe_runs_is_chosen_and_the_better_ones_say_why_not(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "fpu avx2 fma sse4_2 avx512f")
    probe, asked = _probes({"narrow": (False, "its probe died (exit status -4)"), "plain": (True, "")})
    isa, passed_over = cpu_build.first_that_runs(BUILDS, NEEDS, probe)
    assert isa == "plain"
    assert asked == ["narrow", "plain"]  # a build whose flags are not all listed is never run
    assert passed_over == {"wide": "the CPU does not list avx512bw",
                           "narrow": "its probe died (exit status -4)"}  # not the chosen one


def test_the_best_build_that_runs_stops_the_search(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "avx512f avx512bw avx2 fma sse4_2")
    probe, asked = _probes({"wide": (True, "")})
    assert cpu_build.first_that_runs(BUILDS, NEEDS, probe) == ("wide", {})
    assert asked == ["wide"]


def test_where_none_runs_the_portable_build_is_chosen_unprobed(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "avx2 fma sse4_2")
    probe, asked = _probes({"narrow": (False, "it did not compile (no -mfma)"),
                            "plain": (False, "its probe computed 3.0, not 7.0")})
    isa, passed_over = cpu_build.first_that_runs(BUILDS, NEEDS, probe)
    assert isa == "portable" and asked == ["narrow", "plain"]
    assert list(passed_over) == ["wide", "narrow", "plain"]
    assert passed_over["wide"] == "the CPU does not list avx512f, avx512bw"
    assert passed_over["plain"] == "its probe computed 3.0, not 7.0"


def test_a_capped_list_starts_lower(monkeypatch):
    """float_gemm.py passes BUILDS[start:] where INFLIGHT_CPU_ISA caps it: the builds above are not asked."""
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "avx512f avx512bw avx2 fma sse4_2")
    probe, asked = _probes({"narrow": (True, "")})
    assert cpu_build.first_that_runs(BUILDS[1:], NEEDS, probe) == ("narrow", {})
    assert asked == ["narrow"]


def test_a_forced_build_is_checked_by_name(monkeypatch):
    monkeypatch.delenv("INFLIGHT_TEST_ISA", raising=False)
    assert cpu_build.forced_build("INFLIGHT_TEST_ISA", BUILDS) is None
    monkeypatch.setenv("INFLIGHT_TEST_ISA", "")
    assert cpu_build.forced_build("INFLIGHT_TEST_ISA", BUILDS) is None
    monkeypatch.setenv("INFLIGHT_TEST_ISA", "plain")
    assert cpu_build.forced_build("INFLIGHT_TEST_ISA", BUILDS) == "plain"
    monkeypatch.setenv("INFLIGHT_TEST_ISA", "avx512")
    with pytest.raises(ValueError, match=r"INFLIGHT_TEST_ISA='avx512'; one of wide, narrow, plain, portable"):
        cpu_build.forced_build("INFLIGHT_TEST_ISA", BUILDS)


def test_the_native_builds_cap_names_are_the_gemms_builds():
    """INFLIGHT_CPU_ISA takes one set of names for every kernel (one place: quant.BUILDS)."""
    from kernels.cpu import quant
    assert set(cpu_build.NATIVE_CAPS) == set(quant.BUILDS) | {"native"}


def test_inflight_cpu_isa_caps_the_native_flags_and_refuses_an_unknown_name(monkeypatch):
    monkeypatch.delenv("INFLIGHT_CPU_ISA", raising=False)
    monkeypatch.delenv("INFLIGHT_NATIVE_ISA", raising=False)
    assert cpu_build.native_flags() == cpu_build.COMPILE_FLAGS
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx2")
    assert cpu_build.native_flags()[:len(cpu_build.COMPILE_FLAGS)] == cpu_build.COMPILE_FLAGS
    assert {"-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile"} <= set(cpu_build.native_flags())
    monkeypatch.setenv("INFLIGHT_NATIVE_ISA", "native")  # the native cap alone, over INFLIGHT_CPU_ISA's
    assert cpu_build.native_flags() == cpu_build.COMPILE_FLAGS
    monkeypatch.setenv("INFLIGHT_NATIVE_ISA", "portable")
    assert "-mno-avx" in cpu_build.native_flags()
    monkeypatch.delenv("INFLIGHT_NATIVE_ISA")
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_ISA='sse9'"):
        cpu_build.native_flags()


def _zmm_instructions(library) -> int:
    import subprocess
    out = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return sum("%zmm" in line for line in out.splitlines())


@pytest.mark.parametrize("cap", ["avx2", "avx_vnni", "portable"])
def test_a_forced_isa_keeps_the_native_libraries_off_avx512(monkeypatch, tmp_path, cap):
    """The prefill attention's -march=native build (AVX-512 intrinsics where the compiler may use
    them) holds no 512-bit instruction when INFLIGHT_CPU_ISA names a build without AVX-512, so an
    'AVX2 build forced' figure is an AVX2 CPU's, attention included; uncapped it does (the control)."""
    import shutil
    from kernels import cpuinfo
    if not shutil.which("objdump") or "avx512f" not in cpuinfo.cpu_flags():
        pytest.skip("needs objdump and a CPU with AVX-512 (the uncapped control must use it)")
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("INFLIGHT_CPU_ISA", raising=False)
    monkeypatch.delenv("INFLIGHT_NATIVE_ISA", raising=False)
    assert _zmm_instructions(cpu_build.build("prefill_attention")) > 0
    monkeypatch.setenv("INFLIGHT_CPU_ISA", cap)
    capped = cpu_build.build("prefill_attention")
    assert _zmm_instructions(capped) == 0
    assert len(list((tmp_path / "cpu_kernels").glob("prefill_attention-*.so"))) == 2
