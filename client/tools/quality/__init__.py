"""Model quality: perplexity by llama-perplexity's method (`perplexity.py`) and a question set of
storages of one model side by side (`question_set.py`)."""
