"""The CPU engine's weights and KV cache in 2 MB pages (kernels/cpu/huge_pages.py): copies exact and
aligned, memory advised MADV_HUGEPAGE (the `hg` flag of its mapping in /proc/self/smaps) before it
is touched, freed with its last tensor, and INFLIGHT_HUGE_PAGES=0 leaving plain torch tensors. The
engine test checks every packed matrix, float weight and KV cache of a loaded model."""
import gc
import mmap
import sys

import pytest
import torch

from kernels.cpu import huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or huge_pages.thp_mode() not in ("always", "madvise"),
                                reason="needs Linux transparent huge pages (always or madvise)")


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry holding `address`: its range, VmFlags and sizes (kB); {} if none."""
    entries = []
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            entries.append({"range": (lo, hi)})
        else:
            key, _, rest = line.partition(":")
            entries[-1][key] = rest.split() if key == "VmFlags" else int(rest.split()[0])
    return next((e for e in entries if e["range"][0] <= address < e["range"][1]), {})


def advised(t: torch.Tensor) -> bool:
    return "hg" in mapping_of(t.data_ptr()).get("VmFlags", [])


@pytest.fixture
def mappings(monkeypatch) -> list:
    """Every mapping huge_pages makes from here on, by size."""
    made, make = [], huge_pages.mapping
    monkeypatch.setattr(huge_pages, "mapping", lambda nbytes: made.append(nbytes) or make(nbytes))
    return made


def test_the_probe_tells_an_advised_mapping_from_a_plain_one():
    plain = torch.frombuffer(mmap.mmap(-1, 4 << 20), dtype=torch.uint8).fill_(1)
    assert not advised(plain) and mapping_of(plain.data_ptr())["Rss"] >= 4096
    assert advised(huge_pages.mapping(4 << 20))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float16, torch.bfloat16, torch.float32])
def test_a_placed_copy_is_exact_aligned_and_advised(dtype):
    g = torch.Generator().manual_seed(3)
    sources = [(torch.randn(n, generator=g) * 50).to(dtype) for n in (1, 37, 1000, 70001)]  # odd sizes
    placed = [huge_pages.place(s) for s in sources]
    for s, p in zip(sources, placed):
        assert p.dtype == s.dtype and p.shape == s.shape and torch.equal(p, s)
        assert p.data_ptr() != s.data_ptr() and p.data_ptr() % 64 == 0
        assert advised(p), mapping_of(p.data_ptr())
    del sources
    gc.collect()
    assert all(p.abs().sum() >= 0 for p in placed)  # readable after their sources are gone


def test_a_large_array_has_its_own_mapping_on_a_2mb_boundary_freed_with_it():
    big = torch.arange(huge_pages.ARENA // 4 // 4 + 1, dtype=torch.float32).view(-1, 1)  # just over a quarter
    placed = huge_pages.place(big)
    assert torch.equal(placed, big) and placed.data_ptr() % huge_pages.PAGE == 0 and advised(placed)
    lo, hi = mapping_of(placed.data_ptr())["range"]
    assert hi - lo >= big.numel() * 4
    address = placed.data_ptr()
    del placed
    gc.collect()
    assert mapping_of(address).get("range") != (lo, hi)  # unmapped: nothing kept it alive


def test_zeros_are_zero_advised_and_resident_at_once():
    shape = (3, 16, 2, 72)  # a KV cache of 3 blocks, not a page multiple
    z = huge_pages.zeros(shape, torch.bfloat16)
    assert z.shape == shape and z.dtype == torch.bfloat16 and not z.any() and advised(z)
    m = mapping_of(z.data_ptr())
    assert m["Rss"] * 1024 >= z.numel() * 2  # faulted now, not while serving


def test_turned_off_it_leaves_plain_tensors(monkeypatch, mappings):
    monkeypatch.setenv("INFLIGHT_HUGE_PAGES", "0")
    t = torch.ones(1000)
    assert huge_pages.place(t) is t
    z, e = huge_pages.zeros((4, 5), torch.float32), huge_pages.empty((3, 2), torch.bfloat16)
    assert not z.any() and z.shape == (4, 5) and e.shape == (3, 2) and e.dtype == torch.bfloat16
    assert mappings == []


@pytest.mark.parametrize("off", [False, True])
def test_the_engine_streams_its_weights_and_cache_from_advised_memory(tmp_path, monkeypatch, mappings, off):
    """A tiny packed model (every projection a CpuQuantWeight) and a tiny float32 one (FloatLinear):
    every array a decode step streams lies in advised memory, or, with the switch off, none was
    placed (no mapping made)."""
    from backend import LLM, SamplingParams
    from backend.models.float_linear import FloatLinear
    from backend.models.gguf.importer import import_gguf
    from backend.models.make_model import make_model
    from backend.models.quant_linear import QuantLinear
    from gguf_files import K_SHAPE, write_gguf
    if off:
        monkeypatch.setenv("INFLIGHT_HUGE_PAGES", "0")
    float_dir = make_model(tmp_path / "float")
    write_gguf(tmp_path / "m.gguf", float_dir / "tokenizer.json", seed=5, types=("Q4_K",), shape=K_SHAPE)
    packed_dir = import_gguf(tmp_path / "m.gguf", tmp_path / "packed", log=lambda *_: None)
    for path, kind in ((packed_dir, QuantLinear), (float_dir, FloatLinear)):
        llm = LLM(str(path), cpu_kv_cache_tokens=512, max_model_len=256)
        out = llm.generate([[5, 9, 14]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        runner = llm.engine.runner
        arrays = [t for m in runner.model.modules() if isinstance(m, kind)
                  for t in (m.kernel.tiles.values() if kind is QuantLinear else [m.weight])]
        arrays += [t for pair in runner.kv_caches for t in pair]
        assert len(arrays) > 2 * len(runner.kv_caches)
        if off:
            assert mappings == []
        else:
            assert mappings and all(advised(t) for t in arrays), [mapping_of(t.data_ptr()) for t in arrays if not advised(t)]


def test_a_mixture_of_experts_float_panels_are_placed():
    from kernels.cpu import moe
    w = torch.randn(4, 40, 64, generator=torch.Generator().manual_seed(1))
    panels = moe.pack_panels(w)
    assert advised(panels)
    assert torch.equal(panels[:, 0, :, :].transpose(1, 2).reshape(4, 16, 64), w[:, :16])  # panel 0: rows 0-15
