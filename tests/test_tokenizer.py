"""backend.text.tokenizer: encoding parity with transformers' AutoTokenizer, and streaming detokenization.

The reference for encoding is transformers (test-only). Tokenizers are built locally: the default
model's byte-level BPE (backend.models.make_model) and, to cover SentencePiece-style "▁" tokenizers, BPE and
Unigram models trained here on the shipped corpus in the Llama-2 (Prepend/Replace normalizer, byte
fallback, Strip decoder) and Metaspace layouts.
"""
from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tokenizers import Tokenizer as RawTokenizer  # noqa: E402
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from backend.models.make_model import CORPUS_PATH, make_model  # noqa: E402
from backend.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from backend.text.tokenizer import Tokenizer  # noqa: E402

FFFD = "\ufffd"
HYP = settings(derandomize=True, deadline=None, max_examples=150,
               suppress_health_check=[HealthCheck.too_slow])

TEXTS = [
    "Hello world",
    "hello world",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "\nnewline first",
    "line one\nline two\n\nline four\n",
    "\t tab and\r\ncrlf",
    "The server batches requests; in-flight batching keeps the batch full.",
    "café crème brûlée, naïve façade, Zoë, Łódź, Dvořák",
    "emoji 🙂🚀🎉👍 ❤️ 🦀 and a family 👨‍👩‍👧",
    "你好，世界 こんにちは 안녕하세요 مرحبا привет λόγος",
    "math: π ≈ 3.14159, √2, ∑, ∞, → ⇒ 16 × 1024",
    "code:\n    def f(x):\n        return x * 2\n",
    "<s> special tokens </s> inside <unk> text",
    "numbers 0 1 2 3 10 16 1024 4096 1e-5 100%",
    "a",
    " ",
    "",
    "🙂",
    "   ",
    "\n",
]


# ----------------------------------------------------------------------------------------------
# Tokenizer fixtures (built once per session; everything is local, no network)
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("default_model"), seed=0)


@pytest.fixture(scope="module")
def ours(default_dir) -> Tokenizer:
    tok = Tokenizer.from_dir(default_dir)
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def hf(default_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_dir))


def _corpus_paragraphs() -> list[str]:
    return [p for p in CORPUS_PATH.read_text(encoding="utf-8").split("\n\n") if p]


@lru_cache(maxsize=None)
def llama2_style_json() -> str:
    """A Llama-2/Mistral-style tokenizer.json: BPE over "▁"-joined words with byte fallback."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False, limit_alphabet=200)
    tok.train_from_iterator(_corpus_paragraphs(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):  # byte-fallback pieces, as sentencepiece has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    llama = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                    byte_fallback=True))
    llama.add_special_tokens(["<unk>", "<s>", "</s>"])
    llama.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    llama.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    llama.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    return llama.to_str()


@lru_cache(maxsize=None)
def metaspace_unigram_json() -> str:
    """A SentencePiece-Unigram-style tokenizer.json with the Metaspace pre-tokenizer and decoder."""
    tok = RawTokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_corpus_paragraphs(), trainer=trainer)
    return tok.to_str()


def write_checkpoint(path: Path, tokenizer_json: str, config: dict | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


LLAMA_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
                "clean_up_tokenization_spaces": False, "model_max_length": 4096}


def stream(tok: Tokenizer, prompt: list[int], output: list[int], chunks: list[int] | None = None):
    """Feed ``output`` to a fresh detokenizer (one token at a time, or in the given chunk sizes);
    return the deltas, the flushed tail included."""
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, i, sizes = [], 0, list(chunks or [])
    while i < len(output):
        n = sizes.pop(0) if sizes else 1
        deltas.append(detok.add(output[i:i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.num_output_tokens == len(output)
    return deltas


def assert_valid_deltas(deltas: list[str]) -> None:
    for d in deltas:
        assert FFFD not in d, f"delta {d!r} holds half a character"
        d.encode("utf-8")  # no lone surrogates


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

def test_from_dir_without_tokenizer_json_is_none(tmp_path, default_dir):
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((default_dir / name).read_bytes())
    assert Tokenizer.from_dir(tmp_path) is None
    assert Tokenizer.from_dir(str(tmp_path)) is None
    assert Tokenizer.from_dir(tmp_path / "missing") is None


def test_properties_match_hf(ours, hf):
    assert ours.vocab_size == len(hf) == 2000
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert {0, 1, 2} <= ours.all_special_ids
    assert ours.token_to_id("<s>") == 1 and ours.id_to_token(2) == "</s>"


def test_eos_none_without_config(tmp_path, default_dir):
    (tmp_path / "tokenizer.json").write_bytes((default_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None and tok.eos_token_id is None and tok.bos_token_id is None
    # With no tokenizer_config.json the tokenizer.json post-processor alone adds <s>.
    assert tok.encode("hi")[0] == 1


def test_eos_token_as_added_token_dict(tmp_path, default_dir):
    cfg = json.loads((default_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                        "normalized": False, "rstrip": False, "single_word": False}
    write_checkpoint(tmp_path, (default_dir / "tokenizer.json").read_text(), cfg)
    assert Tokenizer.from_dir(tmp_path).eos_token_id == 2


# ----------------------------------------------------------------------------------------------
# Encoding parity with transformers
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(ours, hf, text):
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode(text)[0] == ours.bos_token_id
    assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


@HYP
@given(text=st.text(max_size=80))
def test_encode_matches_hf_random_text(text):
    ours, hf = _default_pair()
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    if not any(s in text for s in ("<s>", "</s>", "<unk>")):
        assert ours.decode(ids) == text  # byte-level BPE round-trips everything


@HYP
@given(ids=st.lists(st.integers(0, 1999), max_size=40))
def test_decode_matches_hf(ids):
    ours, hf = _default_pair()
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_encode_batch(ours):
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]


@lru_cache(maxsize=None)
def _default_pair():
    """(ours, hf) for hypothesis tests, which cannot take function-scoped fixtures cleanly."""
    import tempfile

    from transformers import AutoTokenizer
    d = make_model(Path(tempfile.mkdtemp(prefix="inflight_tok_")), seed=0)
    return Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))


@lru_cache(maxsize=None)
def _dir_pair(kind: str):
    import tempfile

    from transformers import AutoTokenizer
    base = Path(tempfile.mkdtemp(prefix=f"inflight_{kind}_"))
    if kind == "llama2":
        d = write_checkpoint(base, llama2_style_json(), LLAMA_CONFIG)
    else:
        cfg = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("add_bos_token", "add_eos_token")}
        d = write_checkpoint(base, metaspace_unigram_json(), cfg)
    return Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("kind", ["llama2", "unigram"])
@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_style_encode_matches_hf(kind, text):
    ours, hf = _dir_pair(kind)
    assert ours.encode(text) == hf(text)["input_ids"]


@pytest.mark.parametrize("flags", [
    {"add_bos_token": True, "add_eos_token": False},
    {"add_bos_token": False},
    {"add_bos_token": False, "add_eos_token": True},
    {},  # Llama-3 style: no flags at all
])
def test_post_processor_decides_like_hf(tmp_path, default_dir, flags):
    """transformers 5 drops add_bos_token/add_eos_token when tokenizer.json exists: the json's
    post-processor (here: prepend <s>) is what counts."""
    from transformers import AutoTokenizer
    cfg = json.loads((default_dir / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token"), cfg.pop("add_eos_token")
    cfg.update(flags)
    d = write_checkpoint(tmp_path, (default_dir / "tokenizer.json").read_text(), cfg)
    ours, hf = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    for text in ("Hello world", "", " x 🙂"):
        assert ours.encode(text) == hf(text)["input_ids"] == [1] + ours.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("flags, first, last", [
    ({"add_bos_token": True, "add_eos_token": False}, 1, None),
    ({"add_bos_token": True}, 1, None),
    ({"add_bos_token": False, "add_eos_token": True}, None, 2),
    ({"add_bos_token": True, "add_eos_token": True}, 1, 2),
    ({}, None, None),
])
def test_flags_apply_without_post_processor(tmp_path, default_dir, flags, first, last):
    """A tokenizer.json with no post-processor: the config's flags say what to add (as
    transformers 4's Llama tokenizers did)."""
    tj = json.loads((default_dir / "tokenizer.json").read_text())
    tj["post_processor"] = None
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", **flags}
    ours = Tokenizer.from_dir(write_checkpoint(tmp_path, json.dumps(tj), cfg))
    for text in ("Hello world", "", " x 🙂"):
        body = ours.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ([first] if first else []) + body + ([last] if last else [])


def test_qwen2_style_no_bos(tmp_path, default_dir):
    """A ByteLevel post-processor and a null bos_token (Qwen2's layout) add nothing."""
    from transformers import AutoTokenizer
    tj = json.loads((default_dir / "tokenizer.json").read_text())
    tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                            "use_regex": False}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "</s>",
           "pad_token": "</s>", "clean_up_tokenization_spaces": False}
    d = write_checkpoint(tmp_path, json.dumps(tj), cfg)
    ours, hf = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"] == ours.encode(text, add_special_tokens=False)
    assert ours.bos_token_id is None and ours.eos_token_id == 2 and ours.pad_token_id == 2


# ----------------------------------------------------------------------------------------------
# Incremental detokenization: byte-level BPE (the default model)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_text", ["", "The prompt says:", "emoji at the end 🙂"])
def test_stream_equals_full_decode(ours, text, prompt_text):
    prompt = ours.encode(prompt_text)
    output = ours.encode(text, add_special_tokens=False)
    deltas = stream(ours, prompt, output)
    assert "".join(deltas) == ours.decode(output)
    if not any(s in text for s in ("<s>", "</s>", "<unk>")):
        assert "".join(deltas) == text
    assert_valid_deltas(deltas)


def test_multibyte_characters_are_held_back(ours):
    output = ours.encode("🙂", add_special_tokens=False)
    assert len(output) > 1  # the emoji is split across byte-level tokens
    detok = IncrementalDetokenizer(ours, ours.encode("Look:"))
    deltas = [detok.add([t]) for t in output]
    assert deltas[:-1] == [""] * (len(output) - 1) and deltas[-1] == "🙂"
    assert detok.flush() == "" and detok.text == "🙂"


def test_leading_space_kept_byte_level(ours):
    prompt = ours.encode("The server")
    output = ours.encode(" batches requests", add_special_tokens=False)
    deltas = stream(ours, prompt, output)
    assert "".join(deltas) == " batches requests"
    assert deltas[0].startswith(" ")


def test_special_tokens_are_skipped_in_stream(ours):
    body = ours.encode("in flight", add_special_tokens=False)
    output = [1] + body[:1] + [2, 0] + body[1:] + [2]
    deltas = stream(ours, [1], output)
    assert "".join(deltas) == ours.decode(output) == "in flight"


def test_unknown_ids_decode_to_nothing(ours):
    """A padded vocabulary (model vocab > tokenizer vocab) can sample ids the tokenizer lacks."""
    body = ours.encode("ok then", add_special_tokens=False)
    output = body[:1] + [ours.vocab_size + 5] + body[1:]
    assert "".join(stream(ours, [1], output)) == "ok then"


@HYP
@given(text=st.text(max_size=60), prompt_text=st.text(max_size=20), data=st.data())
def test_stream_random_text(text, prompt_text, data):
    ours, _ = _default_pair()
    prompt = ours.encode(prompt_text)
    output = ours.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(output)))
    deltas = stream(ours, prompt, output, chunks)
    assert "".join(deltas) == ours.decode(output)
    if not any(s in text for s in ("<s>", "</s>", "<unk>")):
        assert "".join(deltas) == text
    if FFFD not in text:
        assert_valid_deltas(deltas)


@HYP
@given(output=st.lists(st.integers(0, 1999), max_size=60), prompt_text=st.text(max_size=20),
       data=st.data())
def test_stream_random_token_ids(output, prompt_text, data):
    """Any id sequence (random-model output): the stream equals the full decode, and no delta holds
    a U+FFFD unless the full decode has it there too (invalid bytes, not a split character)."""
    ours, _ = _default_pair()
    prompt = ours.encode(prompt_text)
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(output)))
    deltas = stream(ours, prompt, output, chunks)
    full = ours.decode(output)
    assert "".join(deltas) == full
    if FFFD not in full:
        assert_valid_deltas(deltas)
    else:
        assert sum(d.count(FFFD) for d in deltas) == full.count(FFFD)


def test_stream_random_token_ids_long_seeded(ours):
    """Long random sequences, like a random model's greedy output, one token at a time."""
    rng = random.Random(0)
    for _ in range(20):
        output = [rng.randrange(ours.vocab_size) for _ in range(400)]
        prompt = [1] + [rng.randrange(3, ours.vocab_size) for _ in range(rng.randrange(0, 12))]
        while ours.decode(prompt).endswith(FFFD):  # the prompt ends inside a character
            prompt.append(ours.encode("a", add_special_tokens=False)[0])
        deltas = stream(ours, prompt, output)
        assert "".join(deltas) == ours.decode(output)


def test_stream_of_multibyte_text_has_no_replacement_chars(ours):
    rng = random.Random(1)
    alphabet = "aé€🙂你ł ñ👍\n🚀ü"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        output = ours.encode(text, add_special_tokens=False)
        deltas = stream(ours, ours.encode("x"), output)
        assert "".join(deltas) == text
        assert_valid_deltas(deltas)


def test_add_empty_and_flush_twice(ours):
    detok = IncrementalDetokenizer(ours, [1])
    assert detok.add([]) == "" and detok.flush() == "" and detok.text == ""
    out = ours.encode(" hello", add_special_tokens=False)
    assert "".join(detok.add([t]) for t in out) + detok.flush() == " hello"
    assert detok.flush() == ""


# ----------------------------------------------------------------------------------------------
# Incremental detokenization: SentencePiece-style "▁" tokenizers keep their spaces
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama2", "unigram"])
def test_sentencepiece_leading_spaces(kind):
    tok, _ = _dir_pair(kind)
    prompt = tok.encode("The server")
    output = tok.encode("The server batches requests together", add_special_tokens=False)[2:]
    # Each token decoded on its own loses its space; this is what the window decoding fixes.
    naive = "".join(tok.decode([t]) for t in output)
    assert " " not in naive
    deltas = stream(tok, prompt, output)
    assert "".join(deltas) == " batches requests together"
    for t, d in zip(output, deltas):  # ASCII text: one delta per token, nothing held back
        assert d.startswith(" ") == tok.id_to_token(t).startswith("▁"), (tok.id_to_token(t), d)
    # With only <s> before it, the first word has no space, as in decode(output).
    output = tok.encode("batches requests", add_special_tokens=False)
    assert "".join(stream(tok, [1], output)) == tok.decode(output) == "batches requests"


@pytest.mark.parametrize("kind", ["llama2", "unigram"])
@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_stream_matches_decode(kind, text):
    tok, _ = _dir_pair(kind)
    ids = tok.encode("Prompt: " + text)
    for k in range(1, min(len(ids), 6)):
        prompt, output = ids[:k], ids[k:]
        if tok.decode(prompt).endswith(FFFD):
            continue
        deltas = stream(tok, prompt, output)
        whole, head = tok.decode(ids), tok.decode(prompt)
        assert whole.startswith(head)
        assert "".join(deltas) == whole[len(head):]
        if FFFD not in whole:
            assert_valid_deltas(deltas)


@HYP
@given(text=st.text(max_size=60), split=st.integers(1, 30), data=st.data())
def test_sentencepiece_stream_random_text(text, split, data):
    kind = data.draw(st.sampled_from(["llama2", "unigram"]))
    tok, _ = _dir_pair(kind)
    ids = tok.encode(text)
    k = min(split, len(ids))
    prompt, output = ids[:k], ids[k:]
    assume(not tok.decode(prompt).endswith(FFFD))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(output)))
    deltas = stream(tok, prompt, output, chunks)
    whole, head = tok.decode(ids), tok.decode(prompt)
    assert "".join(deltas) == whole[len(head):]
    if FFFD not in text:
        assert_valid_deltas(deltas)


def test_llama2_byte_fallback_emoji_held_back():
    tok, _ = _dir_pair("llama2")
    ids = tok.encode("Cat 😺!")
    prompt, output = ids[:3], ids[3:]
    assert tok.decode(prompt) == "Cat"
    pieces = [tok.id_to_token(t) for t in output]
    assert sum(p.startswith("<0x") for p in pieces) >= 4  # the cat is four byte-fallback tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in output] + [detok.flush()]
    assert "".join(deltas) == " 😺!"
    assert_valid_deltas(deltas)
    first = pieces.index("<0xF0>")
    assert deltas[first:first + 3] == ["", "", ""] and deltas[first + 3].endswith("😺")


@pytest.mark.parametrize("piece", ["Ģ", "ð", "Ã"])  # bytes 0x80 (continuation), 0xF0, 0xC3 (leads)
def test_invalid_bytes_are_not_held_forever(ours, piece):
    """A random model can emit byte tokens that never form a character: the stream still flows
    (within max_hold_tokens) and still equals the full decode."""
    bad = ours.token_to_id(piece)
    assert bad is not None
    output = [bad] * 60 + ours.encode(" fine", add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, ours.encode("x"))
    deltas = [detok.add([t]) for t in output]
    first = next(i for i, d in enumerate(deltas) if d)
    assert first <= IncrementalDetokenizer.max_hold_tokens
    deltas.append(detok.flush())
    assert "".join(deltas) == ours.decode(output) == FFFD * 60 + " fine"
