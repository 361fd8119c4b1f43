"""Text in and out: tokenizers, incremental detokenizing, chat templates (no torch)."""
