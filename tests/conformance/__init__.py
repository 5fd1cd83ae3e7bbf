"""Conformance suite: every cache of the project, against `transformers.DynamicCache`, over tiny random models and
every `generate` mode.

- `cases.py`   the registry: one `CacheCase` per cache (append there to put a new cache under test)
- `models.py`  tiny random models (Llama, Mistral, Qwen2, Gemma 3 text) and their assistant models
- `modes.py`   one `run_<mode>(model, cache_factory, assistant)` per generate mode
- `compare.py` the assertions that a run conforms to the reference run
"""
