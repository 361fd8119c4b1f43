"""One place for each default a request may leave out, read by every door (the Python API's
SamplingParams, the Triton tensors, the OpenAI API's completions) and by the docs' tables."""

MAX_TOKENS = 16  # a request's max_tokens when it names none (vLLM's and OpenAI's legacy completions')
