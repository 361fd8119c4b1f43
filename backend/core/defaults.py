"""One place for each default a request may leave out, read by every door (the Python API's
SamplingParams, the Triton tensors, the OpenAI API's completions) and by the docs' tables."""

MAX_TOKENS = 16  # a request's max_tokens when it names none (vLLM's and OpenAI's legacy completions')

# Adapters loaded and unloaded at run time (/v1/load_lora_adapter, the Triton door's lora_action):
# off unless switched on, as vLLM keeps them behind this environment variable (docs/lora.md).
ENABLE_RUNTIME_LORA = False
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

# The runner (EngineConfig.runner, `inflight serve --runner`): auto picks pooling for an embedding or
# reranker checkpoint and generate for any other, as vLLM's --runner auto (docs/pooling.md).
RUNNER = "auto"

# Images (docs/vision.md). At most this many images in one prompt (EngineConfig.limit_mm_per_prompt,
# vLLM's name and JSON shape {"image": N}); the encoder's outputs kept by image hash within this many
# bytes (encoder_cache_bytes); an image's encoded bytes and pixels refused past these (a decompression
# bomb never decodes).
LIMIT_IMAGES_PER_PROMPT = 8
ENCODER_CACHE_BYTES = 128 * 2**20
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 40_000_000
