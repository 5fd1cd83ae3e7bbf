"""Memory planning: weights + KV-cache bytes for a model config, context, batch and cache format.

One concept per module: `configs` (shipped and loaded model configs), `parameters` (weight count from a
config), `formats` (bytes of each KV storage format and weight dtype), `units` (memory strings and
byte formatting), `plan` (the `Plan` and the largest context or batch that fits). The public entry
point is :mod:`hf_kvplus.planner`.
"""
