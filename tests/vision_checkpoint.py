"""A tiny random Gemma3ForConditionalGeneration written by transformers itself (test-only): the text
model of tests/hf_checkpoints.py's gemma3 shape (a 13-token sliding window) and a two-layer SigLIP
tower on 48-pixel images in 8-pixel patches (36 patches), pooled to 9 image tokens; the image tokens
inside the 512-token vocabulary. transformers' own greedy generation is the oracle."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

from hf_checkpoints import COMMON, SHAPES

IMAGE_TOKEN, BOI, EOI = 500, 498, 499
TOKENS_PER_IMAGE = 9
IMAGE_SIZE = 48


IMAGE_MARKERS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")  # ids 2000-2002 with a tokenizer
CHAT_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def make_vision_checkpoint(out_dir: Path, seed: int = 0, tokenizer: bool = False, **text_overrides) -> Path:
    """`tokenizer`: with the default model's tokenizer plus Gemma 3's three image tokens (ids 2000,
    2001, 2002 in a 2048-token vocabulary) and a chat template, for the text doors. `text_overrides`: the text
    model's config values in place of the gemma3 shape's."""
    import transformers as tf
    torch.manual_seed(seed)
    ids = dict(image_token_index=2002, boi_token_index=2000, eoi_token_index=2001) if tokenizer else \
        dict(image_token_index=IMAGE_TOKEN, boi_token_index=BOI, eoi_token_index=EOI)
    text = tf.Gemma3TextConfig(**{**COMMON, **SHAPES["gemma3"], **({"vocab_size": 2048} if tokenizer else {}),
                                  **text_overrides})
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=IMAGE_SIZE, patch_size=8, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             mm_tokens_per_image=TOKENS_PER_IMAGE, initializer_range=0.1, **ids)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                param.normal_(0, 0.3)  # Gemma's norms start at 0 (1 + w)
            elif name.endswith("mm_input_projection_weight"):
                param.normal_(0, 1.0)  # image rows as large as the scaled token embeddings
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        _write_tokenizer(Path(out_dir))
    return Path(out_dir)


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken

    from backend.models.make_model import BOS_TOKEN, EOS_TOKEN, train_tokenizer
    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_MARKERS])
    assert [tok.token_to_id(t) for t in IMAGE_MARKERS] == [2000, 2001, 2002]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": True, "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))


def random_image(seed: int, width: int, height: int, mode: str = "RGB"):
    from PIL import Image
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": None}[mode]
    shape = (height, width) if channels is None else (height, width, channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def image_bytes(image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def oracle_ids(prompt: list[int]) -> list[int]:
    """A token prompt with each BOI expanded as the engine does (BOI, the image tokens, EOI)."""
    out = []
    for t in prompt:
        out += [BOI] + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [EOI] if t == BOI else [t]
    return out


def hf_generate(model, prompt: list[int], images: list, max_tokens: int) -> list[int]:
    """transformers' greedy continuation of a token prompt with its images (pixels from
    Gemma3ImageProcessorPil, bidirectional image attention through token_type_ids)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    ids = oracle_ids(prompt)
    kwargs = {}
    if images:
        proc = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        kwargs["pixel_values"] = proc(images, return_tensors="pt")["pixel_values"]
        kwargs["token_type_ids"] = torch.tensor([[int(t == IMAGE_TOKEN) for t in ids]])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, **kwargs)
    return out[0, len(ids):].tolist()


def write_config_value(folder: Path, **values) -> None:
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(values)
    path.write_text(json.dumps(cfg))
