"""What hf_kvplus knows about model families beyond their configs, from running every decoder of Transformers
(`tests/test_architectures.py`, the table in docs/architectures.md).

A config says how many KV heads a layer has and what kind of attention it runs; it does not say how the model's
code treats what the cache returns. Paged, quantized and evicting caches hand attention placeholders (or unordered
slots) that only hf_kvplus's attention reads, so a family whose code computes on the cached keys and values itself
can only use dense caches; a family that runs one attention module over several cache layers fits no per-layer
cache. Each entry names the reason, which the refusal quotes. Families not listed that turn out to bypass the
attention path are still caught, at their first decode step (`KVLayer`).
"""

from __future__ import annotations

#: Families no hf_kvplus cache serves.
REFUSED: dict[str, str] = {
    "hrm_text": "it runs one attention module over several cache layers (its reasoning cycles)",
}

#: Families whose attention cannot read a cache's storage in place: dense caches (DenseCache, OffloadedCache, full
#: precision) serve them.
DENSE_ONLY: dict[str, str] = {
    "diffllama": "its differential attention splits the cached values into two attention calls",
    "doge": "it computes its attention mask from the cached values, outside attention",
    "falcon": "its attention computes on its own, not through Transformers' attention functions",
    "jetmoe": "its mixture of attention heads repeats the cached keys and values before attending",
}
#: Why multi-head latent attention (a config with `kv_lora_rank`) is dense-only: what it caches is not K and V.
LATENT = "its latent attention caches the compressed latent and its rotary key, and expands them before attending"


def dense_only(model_type: str, config) -> str | None:
    """Why this family's attention cannot read a storage in place, or None."""
    return DENSE_ONLY.get(model_type) or (LATENT if getattr(config, "kv_lora_rank", None) else None)


def layer_shape(model_type: str, layer_type: str, config, shape: tuple[int, int]) -> tuple[int, int]:
    """(KV heads, key head_dim) a layer's cache holds, where the model's code departs from what its config says
    (`shape`): MiMo-V2-Flash's sliding layers hold twice the configured KV heads; latent attention caches one
    latent "head" of `kv_lora_rank` per token as its keys (its rotary key as the values)."""
    if model_type == "mimo_v2_flash" and layer_type == "sliding_attention":
        return 2 * shape[0], shape[1]
    if getattr(config, "kv_lora_rank", None):
        return 1, config.kv_lora_rank
    return shape
