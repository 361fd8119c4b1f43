"""engine: requests in, outputs out, on top of every other layer.

Owns `LLMEngine` (`llm_engine.py`: one step is schedule -> run -> update), the engine on its own
thread for the server (`async_engine.py`), the offline API (`llm.py`: `LLM`), turning tokens into
text and stop strings on the delivery side (`output_processor.py`), where queued requests stand
(`queue_report.py`), LoRA adapters by name (`loras.py`), pooling requests and the runner a checkpoint gets (`pooling.py`), the KV tiers built for an engine
(`kv_tiers.py`), and the compilation of structured-output constraints off the request path
(`structured/`).

May import every layer below it.
"""
