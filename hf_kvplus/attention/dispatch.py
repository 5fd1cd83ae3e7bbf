"""Routing attention to hf_kvplus for its caches, and to the unchanged original for everything else.

Models look their attention function up by name on every forward (`ALL_ATTENTION_FUNCTIONS`), and the
key tensor they pass is the very object the cache's `update` returned. Installing puts one function
under both "sdpa" (the default attention of `from_pretrained`) and "kvplus": keys that carry a
hf_kvplus layer are attended by that layer; any other call is handed, arguments untouched, to the
function "sdpa" had before, so other caches and models compute bit-identically.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .route import KV_SOURCE_ATTR

#: The name of the explicit attention implementation: `from_pretrained(..., attn_implementation="kvplus")`.
ATTN_IMPLEMENTATION = "kvplus"

#: Attention implementations whose calls reach `kvplus_attention`, so a cache may attend in place.
FUSED_ATTENTION = ("sdpa", ATTN_IMPLEMENTATION)

_fallback = sdpa_attention_forward


def takes_fused_path(config) -> bool:
    """Whether a model with this config attends through `kvplus_attention` (and not eager or another)."""
    return getattr(config, "_attn_implementation", None) in FUSED_ATTENTION


def kvplus_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """An `AttentionInterface` function: our layers' attention for our caches, SDPA for all else."""
    layer = getattr(key, KV_SOURCE_ATTR, None)
    if layer is None:
        return _fallback(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(module, query, key, value, attention_mask, scaling, **kwargs), None


def install() -> None:
    """Registers "kvplus" (with SDPA's mask) and routes "sdpa" through `kvplus_attention`. Idempotent."""
    global _fallback
    current = AttentionInterface._global_mapping.get("sdpa")
    if current is not kvplus_attention:
        _fallback = current
        AttentionInterface.register("sdpa", kvplus_attention)
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvplus_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def uninstall() -> None:
    """Gives "sdpa" back its previous function (the "kvplus" name stays registered)."""
    if AttentionInterface._global_mapping.get("sdpa") is kvplus_attention:
        AttentionInterface.register("sdpa", _fallback)
