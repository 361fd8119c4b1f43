"""SmolLM2-135M-Instruct (the `make serve` model, imported from its GGUF) in our engine against
transformers' `generate` on the same folder: greedy, float32, token for token, on plain and
chat-formatted prompts, all in one in-flight batch on our side."""
import pytest
import torch

from backend import LLM, SamplingParams
from backend.text.tokenizer import Tokenizer
from smollm2 import smollm2_dir

MAX_NEW_TOKENS = 16
PLAIN = ["Once upon a time", "The capital of France is", "def fibonacci(n):",
         "Ünïcödé → 日本語のテキスト", "1, 2, 3, 4,"]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """(label, token ids): chat prompts rendered by the checkpoint's template, which writes its
    own special tokens, so they are encoded without adding any."""
    out = [(text, tokenizer.encode(text)) for text in PLAIN]
    for question in CHATS:
        text = tokenizer.render_chat([{"role": "user", "content": question}])
        out.append((f"chat: {question}", tokenizer.encode(text, add_special_tokens=False)))
    return out


@pytest.fixture(scope="module")
def ours(model_dir, prompts):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, max_tokens_in_paged_kv_cache=4096)
    return llm.generate([ids for _, ids in prompts],
                        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0))


def hf_greedy(model, ids: list[int], eos_id: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos_id,
                         pad_token_id=eos_id)
    return out[0, len(ids):].tolist()


def test_greedy_token_exact_against_transformers(model_dir, tokenizer, prompts, ours):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert len(prompts) >= 8
    for (label, ids), out in zip(prompts, ours):
        expected = hf_greedy(hf, ids, tokenizer.eos_token_id)
        assert list(out.token_ids) == expected, f"{label!r}: ours {out.text!r} vs transformers {tokenizer.decode(expected)!r}"


def test_chat_answer_names_paris_and_stops_at_end_of_turn(prompts, ours, tokenizer):
    label_index = [label for label, _ in prompts].index("chat: What is the capital of France?")
    answer = ours[label_index]
    assert "Paris" in answer.text, answer.text
    # The answer ends with <|im_end|>, the checkpoint's eos, before the token limit.
    assert answer.finish_reason == "stop" and len(answer.token_ids) < MAX_NEW_TOKENS
    assert tokenizer.eos_token == "<|im_end|>"
