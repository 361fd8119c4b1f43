"""A tiny random Qwen3 that chats in Qwen3's format (test-only): transformers' Qwen3ForCausalLM with
random weights (tests/hf_checkpoints.py), the repository's small BPE tokenizer with Qwen3's chat
tokens added (`<|im_start|>`, `<|im_end|>` special, the end of a turn and EOS; `<think>`, `</think>`,
`<tool_call>`, `</tool_call>` plain tokens, kept in the text as Qwen3's tokenizer keeps them), and a
chat template in Qwen3's format: ChatML turns, the tools in the system turn, and with
`enable_thinking: false` the empty think block `<think>\\n\\n</think>\\n\\n` after the assistant's
opening, as Qwen3's own template writes it.
"""
from __future__ import annotations

import json
from pathlib import Path

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PLAIN_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, write <tool_call>\\n<function=name>\\n<parameter=p>\\nvalue\\n'"
    " + '</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def make_qwen3_chat(out_dir: Path, seed: int = 0) -> Path:
    from tokenizers import AddedToken

    from backend.models.make_model import BOS_TOKEN, UNK_TOKEN, train_tokenizer
    from hf_checkpoints import make_checkpoint

    out_dir = Path(out_dir)
    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(IM_START, special=True, normalized=False),
                            AddedToken(IM_END, special=True, normalized=False)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_TOKENS])
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id(IM_END)
    make_checkpoint("qwen3", out_dir, seed=seed, vocab_size=vocab, bos_token_id=tok.token_to_id(BOS_TOKEN),
                    eos_token_id=eos, pad_token_id=tok.token_to_id(UNK_TOKEN), max_position_embeddings=1024)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_eos_token": False, "bos_token": None, "eos_token": IM_END,
        "pad_token": UNK_TOKEN, "unk_token": UNK_TOKEN, "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out_dir
