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

from .architectures import REFUSED, dense_only, layer_shape
from .errors import UnsupportedModelError
from .kernels.decode_attention import MAX_HEAD_DIM, MIN_HEAD_DIM

#: Layer types of `config.layer_types` that hold a per-token KV cache, and how a cache keeps them.
ATTENTION_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
#: Layer types that share another layer's cache or have no attention: they get Transformers' placeholder.
NO_CACHE_LAYER_TYPES = {"dummy", "moe", "mlp"}
#: Layer types with a recurrent state instead of per-token KV (linear-attention hybrids): they get Transformers'
#: own layer for it, as DynamicCache builds it.
LINEAR_LAYER_TYPES = {"linear_attention", "conv"}


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: its kind, window (sliding or chunk size), and KV head shape."""

    index: int
    kind: str  # "full", "sliding", "chunked", "linear" (a recurrent state) or "none" (no KV of its own)
    window: int | None
    num_kv_heads: int
    head_dim: int

    @property
    def holds_kv(self) -> bool:
        return self.kind not in ("none", "linear")

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
    #: Why this family's attention cannot read a storage in place (`architectures.DENSE_ONLY`), or None.
    dense_only: str | None = None

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
        if model_type in REFUSED:
            raise UnsupportedModelError(f"{model_type}: hf_kvplus caches cannot serve it: {REFUSED[model_type]}")
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        # transformers < 5.22 returns one kwargs dict for all layers, later versions one per layer.
        per_layer_kwargs = layer_kwargs if isinstance(layer_kwargs, list) else [layer_kwargs] * len(layer_types)
        shapes = [
            layer_shape(model_type, t, text, shape)
            for t, shape in zip(layer_types, _layer_shapes(text, len(layer_types)), strict=True)
        ]
        attention = {shape for t, shape in zip(layer_types, shapes, strict=True) if t in ATTENTION_LAYER_KINDS}
        for num_kv_heads, head_dim in sorted(attention):
            if num_heads % num_kv_heads:
                raise UnsupportedModelError(
                    f"{model_type}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
                )
            if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
                raise UnsupportedModelError(
                    f"{model_type}: head_dim {head_dim} is outside the {MIN_HEAD_DIM}..{MAX_HEAD_DIM} range the "
                    "attention kernels handle"
                )
        unknown = sorted(set(layer_types) - set(ATTENTION_LAYER_KINDS) - NO_CACHE_LAYER_TYPES - LINEAR_LAYER_TYPES)
        if unknown:
            raise UnsupportedModelError(
                f"{model_type}: layer types {unknown} (of {len(layer_types)} layers) are not layers hf_kvplus can "
                f"cache; supported: {sorted(ATTENTION_LAYER_KINDS)}, with {sorted(LINEAR_LAYER_TYPES)} layers "
                f"(Transformers' own) and {sorted(NO_CACHE_LAYER_TYPES)} layers (none) beside them"
            )
        if all(t in NO_CACHE_LAYER_TYPES | LINEAR_LAYER_TYPES for t in layer_types):
            raise UnsupportedModelError(f"{model_type}: none of its {len(layer_types)} layers is an attention layer")
        layers = tuple(
            LayerSpec(
                index=i,
                kind=ATTENTION_LAYER_KINDS.get(t, "linear" if t in LINEAR_LAYER_TYPES else "none"),
                window=kwargs.get("sliding_window"),
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
            )
            for i, (t, kwargs, (num_kv_heads, head_dim)) in enumerate(
                zip(layer_types, per_layer_kwargs, shapes, strict=True)
            )
        )
        return cls(
            model_type=model_type, num_attention_heads=num_heads, layers=layers, dense_only=dense_only(model_type, text)
        )


def _layer_shapes(text: PreTrainedConfig, num_layers: int) -> list[tuple[int, int]]:
    """(KV heads, key head_dim) of each layer, as the model's attention makes them: from each layer's own config
    where the config has them (`per_layer_config`, transformers >= 5.22: layers may differ), one query head
    shared by all (`multi_query`), keys of `qk_head_dim` (values may be narrower) or `dim_head` where the config
    names it so. (`architectures.layer_shape` then corrects what a family's code does differently.)"""
    configs = getattr(text, "per_layer_config", None) or [text] * num_layers
    shapes = []
    for config in configs:
        heads = config.num_attention_heads
        kv_heads = 1 if getattr(config, "multi_query", False) else getattr(config, "num_key_value_heads", None)
        head_dim = next(
            (getattr(config, name) for name in ("qk_head_dim", "head_dim", "dim_head") if getattr(config, name, None)),
            config.hidden_size // heads,
        )
        shapes.append((kv_heads or heads, head_dim))
    return shapes
