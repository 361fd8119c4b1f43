"""A tiny random Qwen2_5_VLForConditionalGeneration written by transformers itself (test-only), with
its preprocessor_config.json (Qwen2VLImageProcessorPil's): a two-layer Qwen2 text model (64 wide,
4 heads of 16, M-RoPE sections 2/3/3) in the 512-token vocabulary, and a three-block vision encoder
on 4-pixel patches merged 2 x 2 (an image's sides are multiples of 8 pixels), windows of 2 x 2
merged patches (16 pixels) with block 1 attending over the whole image; images of 256 to 4096
pixels (4 to 64 tokens). transformers' own greedy generation is the oracle."""
from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD = 500, 498, 499, 497
PATCH, MERGE = 4, 2
MIN_PIXELS, MAX_PIXELS = 256, 4096
MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # ids 2000-2002 with a tokenizer
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_qwen2_5_vl_checkpoint(out_dir: Path, seed: int = 0, tokenizer: bool = False, **text) -> Path:
    """`tokenizer`: with the default model's tokenizer plus the three image tokens (ids 2000-2002 in a
    2048-token vocabulary) and a chat template, for the text doors. `text`: text config overrides."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    torch.manual_seed(seed)
    ids = dict(vision_start_token_id=2000, vision_end_token_id=2001, image_token_id=2002, video_token_id=2003) \
        if tokenizer else dict(vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                               image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD)
    text_config = dict(vocab_size=2048 if tokenizer else 512, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                           "mrope_section": [2, 3, 3]},
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, **text)
    vision_config = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                         spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                         out_hidden_size=64, tokens_per_second=2)
    config = tf.Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **ids)
    model = tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0, 0.1)  # (transformers' 0.02 leaves the logits nearly tied)
    model.save_pretrained(out_dir, safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE,
                             temporal_patch_size=2).save_pretrained(out_dir)
    if tokenizer:
        _write_tokenizer(Path(out_dir))
    return Path(out_dir)


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken

    from backend.models.make_model import BOS_TOKEN, EOS_TOKEN, train_tokenizer
    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MARKERS])
    assert [tok.token_to_id(t) for t in MARKERS] == [2000, 2001, 2002]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": True, "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))


def processor(folder: Path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil.from_pretrained(str(folder))


def oracle_inputs(folder: Path, prompt: list[int], images: list, pad: int = IMAGE_PAD) -> tuple[list[int], dict]:
    """(the prompt with each image pad expanded as Qwen2_5_VLProcessor does, the model's image kwargs)."""
    if not images:
        return list(prompt), {}
    out = processor(folder)(images, return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // MERGE ** 2).tolist())
    ids = []
    for t in prompt:
        ids += [pad] * next(counts) if t == pad else [t]
    return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                 "mm_token_type_ids": torch.tensor([[int(t == pad) for t in ids]])}


def hf_generate(model, folder: Path, prompt: list[int], images: list, max_tokens: int) -> list[int]:
    """transformers' greedy continuation of a token prompt (one pad per image) with its images."""
    ids, kwargs = oracle_inputs(folder, prompt, images)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, **kwargs)
    return out[0, len(ids):].tolist()


def hf_logprobs(model, folder: Path, prompt: list[int], images: list, output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at each output position, teacher-forced."""
    ids, kwargs = oracle_inputs(folder, prompt, images)
    full = ids + output
    if images:
        kwargs["mm_token_type_ids"] = torch.tensor([[int(t == IMAGE_PAD) for t in full]])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full]), **kwargs).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(ids) - 1:-1]
