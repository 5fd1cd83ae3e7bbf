"""Block pools and layer tensors of a model, shared by the PagedCaches built on them."""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from ..errors import CacheMismatchError, ConfigError
from ..model_spec import LayerSpec, ModelSpec
from .block_pool import BlockPool
from .layer_pool import LayerPool
from .prefix_store import PrefixStore

#: Block size in tokens. 16 is vLLM's default: a block of K/V for head_dim 128 in fp16 is 4 KiB per
#: head, a whole number of the decode kernel's 16..64-key tiles, and a sequence wastes at most 15
#: token slots per layer.
DEFAULT_BLOCK_SIZE = 16
#: A growable pool starts this small: a short prompt should not hold a large empty pool at rest.
GROWABLE_INITIAL_BLOCKS = 8


def group_key(spec: LayerSpec) -> str:
    """Layers holding the same tokens share blocks: all full layers, the sliding layers of one window."""
    return "full" if spec.kind == "full" else f"{spec.kind}:{spec.window}"


class PagedPool:
    """Per layer group, a `BlockPool` of block ids; per layer, the tensors those ids index.

    One pool serves many caches (calls, tenants): blocks are reference-counted, so a prefix block can
    live in the pool after the cache that wrote it is gone and be attached to a later cache, through
    `prefix_store` (full-attention models only: a sliding layer drops the prefix it would share).
    `num_blocks` fixes each group's pool; `max_bytes` fixes them from a memory budget instead (split
    between groups in proportion to their layer counts; `dtype`, default the config's, sizes a block);
    with neither, pools grow on demand.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        max_bytes: int | None = None,
        dtype: torch.dtype | None = None,
    ):
        if block_size < 8 or block_size > 128 or block_size & (block_size - 1):
            raise ConfigError(f"block_size must be a power of two in 8..128, got {block_size}")
        if num_blocks is not None and num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1 (or None to grow on demand), got {num_blocks}")
        self.block_size = block_size
        if num_blocks is not None and max_bytes is not None:
            raise ConfigError(f"give num_blocks ({num_blocks}) or max_bytes ({max_bytes}), not both")
        self.model_spec = ModelSpec.from_config(config)
        if max_bytes is not None:
            budgets = self._blocks_for_budget(config, block_size, max_bytes, dtype)
        self.blocks: dict[str, BlockPool] = {}
        self.layers: dict[int, LayerPool] = {}
        for spec in self.model_spec.layers:
            if not spec.holds_kv:
                continue
            key = group_key(spec)
            if key not in self.blocks:
                fixed = budgets[key] if max_bytes is not None else num_blocks
                self.blocks[key] = BlockPool(fixed, initial=GROWABLE_INITIAL_BLOCKS)
            self.layers[spec.index] = LayerPool(self.blocks[key], block_size, spec.num_kv_heads, spec.head_dim)
        only_full = set(self.blocks) == {"full"}
        self.prefix_store = PrefixStore(self.blocks["full"], block_size) if only_full else None

    def _blocks_for_budget(self, config, block_size: int, max_bytes: int, dtype) -> dict[str, int]:
        dtype = dtype or getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        layers: dict[str, list[LayerSpec]] = {}
        for spec in self.model_spec.layers:
            if spec.holds_kv:
                layers.setdefault(group_key(spec), []).append(spec)
        total = sum(len(group) for group in layers.values())
        budgets = {}
        for key, group in layers.items():
            block_bytes = sum(2 * s.num_kv_heads * block_size * s.head_dim * dtype.itemsize for s in group)
            budgets[key] = max_bytes * len(group) // total // block_bytes
            if budgets[key] < 1:
                raise ConfigError(
                    f"max_bytes {max_bytes:,} leaves {max_bytes * len(group) // total:,} bytes for the {key} layers, "
                    f"less than one block of {block_bytes:,} bytes ({len(group)} layers x {block_size} tokens in {dtype})"
                )
        return budgets

    def check_model(self, spec: ModelSpec) -> None:
        """A pool serves caches of the model it was built for, no other."""
        if spec != self.model_spec:
            raise CacheMismatchError(
                f"this PagedPool was built for a {self.model_spec.model_type} with {self.model_spec.num_layers} layers; "
                f"the cache is for a {spec.model_type} with {spec.num_layers} layers"
            )
