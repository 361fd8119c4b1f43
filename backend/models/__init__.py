"""models: the decoder and everything that builds it, torch modules with no scheduling in them.

Owns the one decoder of every architecture (`llama.py`, `moe.py`, `rope.py`, the attention layer
over the step's `AttentionContext`, `attention.py`), the linear layers (`packed_linear.py`,
`quant_linear.py`, `cpu_weight_choice.py`), building a model from a checkpoint (`loader.py`:
config.json and safetensors, every value checked by `checkpoint_config.py` and held to the weights'
shapes by `weight_shapes.py`, for config.json and GGUF alike; `weights.py`), tensor-parallel sharding (`parallel/`), LoRA's
adapter files and per-step products (`lora/`), GGUF import (`gguf/`), the expert-load tally of
mixtures of experts (`expert_load.py`), how a pooling checkpoint pools (`pooling_config.py`) and the random test checkpoint (`make_model.py`).

May import core and kernels; the worker builds and runs what is here.
"""
