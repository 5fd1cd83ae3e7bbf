"""What a cache needs to know about a model: its attention layers and their shapes.

Read once from the model config (the same way Transformers' own caches read it), so that a model the
cache cannot serve is refused at construction, and a cache used on another model is caught at its
first call instead of failing deep inside attention. Under tensor parallelism a rank holds a share of
each layer's KV heads, which the config does not say: a layer learns it at its first update
(`LayerSpec.rank_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from .errors import UnsupportedModelError
from .kernels.decode_attention import MAX_HEAD_DIM, MIN_HEAD_DIM

#: Layer types of `config.layer_types` that hold a per-token KV cache, and how a cache keeps them.
ATTENTION_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
#: Layer types that share another layer's cache or have no attention: they get Transformers' placeholder.
NO_CACHE_LAYER_TYPES = {"dummy", "moe", "mlp"}


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: its kind, window (sliding or chunk size), and KV head shape."""

    index: int
    kind: str  # "full", "sliding", "chunked" or "none" (no KV of its own)
    window: int | None
    num_kv_heads: int
    head_dim: int

    @property
    def holds_kv(self) -> bool:
        return self.kind != "none"

    def rank_share(self, heads: int) -> LayerSpec | None:
        """This layer as one tensor-parallel rank holds it, if `heads` KV heads are such a rank's share (an
        initialized process group whose size the split divides); None otherwise."""
        if heads == self.num_kv_heads or heads < 1 or self.num_kv_heads % heads:
            return None
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        if torch.distributed.get_world_size() % (self.num_kv_heads // heads):
            return None
        return replace(self, num_kv_heads=heads)


@dataclass(frozen=True)
class ModelSpec:
    """The attention geometry of a decoder: one `LayerSpec` per layer."""

    model_type: str
    num_attention_heads: int
    layers: tuple[LayerSpec, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def from_config(cls, config: PreTrainedConfig) -> ModelSpec:
        """Reads the decoder's layer types, KV heads and head_dim; refuses what the caches cannot hold."""
        text = config.get_text_config(decoder=True)
        model_type = getattr(text, "model_type", type(text).__name__)
        num_heads = getattr(text, "num_attention_heads", None)
        if not num_heads:
            raise UnsupportedModelError(
                f"model_type {model_type!r} has no attention heads in its config (num_attention_heads="
                f"{num_heads!r}); hf_kvplus caches serve attention layers only"
            )
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        # transformers < 5.22 returns one kwargs dict for all layers, later versions one per layer.
        per_layer_kwargs = layer_kwargs if isinstance(layer_kwargs, list) else [layer_kwargs] * len(layer_types)
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"{model_type}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
            )
        if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
            raise UnsupportedModelError(
                f"{model_type}: head_dim {head_dim} is outside the {MIN_HEAD_DIM}..{MAX_HEAD_DIM} range the "
                "attention kernels handle"
            )
        unknown = sorted({t for t in layer_types} - set(ATTENTION_LAYER_KINDS) - NO_CACHE_LAYER_TYPES)
        if unknown:
            raise UnsupportedModelError(
                f"{model_type}: layer types {unknown} (of {len(layer_types)} layers) are not attention layers "
                f"hf_kvplus can cache; supported: {sorted(ATTENTION_LAYER_KINDS)}"
            )
        if all(t in NO_CACHE_LAYER_TYPES for t in layer_types):
            raise UnsupportedModelError(f"{model_type}: none of its {len(layer_types)} layers is an attention layer")
        layers = tuple(
            LayerSpec(
                index=i,
                kind=ATTENTION_LAYER_KINDS.get(t, "none"),
                window=kwargs.get("sliding_window"),
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
            )
            for i, (t, kwargs) in enumerate(zip(layer_types, per_layer_kwargs, strict=True))
        )
        return cls(model_type=model_type, num_attention_heads=num_heads, layers=layers)
