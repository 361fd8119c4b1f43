"""A sequence's tokens as every layer reads them: its prompt, then its output. The scheduler's
`Request` (request.py) and the worker's `SeqState` (backend/worker/input_batch.py) both hold
`prompt_token_ids` and `output_token_ids`; this is what they answer from them."""
from __future__ import annotations


class TokenSequence:
    """Mixed into a class with `prompt_token_ids` and `output_token_ids` lists."""
    __slots__ = ()
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the rest (a decode row asks for one token)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
