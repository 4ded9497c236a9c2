"""Generated checkpoints for tests, benchmarks and the tiny embedded lane: the tiny GLM-5.3 (tiny.py)
and its tokenizer, and header-true synthetic checkpoints (checkpoints.py). Not product code."""
