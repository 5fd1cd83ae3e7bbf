"""The model a cache belongs to, read from its config: what a saved cache and a persistent prefix store are keyed by.

Two configs with equal fingerprints write the same K/V shapes at the same positions under the same rotary
embedding; weights are not part of it (a file cannot tell two checkpoints of one architecture apart).
"""

from __future__ import annotations

import json

from xxhash import xxh3_64_hexdigest

from .model_spec import ModelSpec

#: Config fields that change the K/V a model writes at a position, beside the attention geometry.
_CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings", "rope_theta",
    "rope_parameters", "rope_scaling", "partial_rotary_factor", "query_pre_attn_scalar", "sliding_window",
)  # fmt: skip


def fingerprint(config) -> dict:
    """The model's geometry and the config fields above, as JSON values."""
    spec = ModelSpec.from_config(config)
    text = config.get_text_config(decoder=True)
    found = {"model_type": spec.model_type, "num_attention_heads": spec.num_attention_heads}
    found["layers"] = [[s.kind, s.window, s.num_kv_heads, s.head_dim] for s in spec.layers]
    for name in _CONFIG_FIELDS:
        value = getattr(text, name, None)
        if value is not None:
            found[name] = _jsonable(value)
    return found


def digest(value) -> str:
    """16 hex digits naming a JSON value (a fingerprint, a block layout)."""
    return xxh3_64_hexdigest(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
