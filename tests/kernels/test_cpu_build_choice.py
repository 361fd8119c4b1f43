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
