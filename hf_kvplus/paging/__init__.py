"""Paging: block ids with reference counts (`BlockPool`), reusable prompt blocks (`PrefixStore`), the
per-layer block tensors of a model (`LayerPool`, `QuantLayerPool`, `PagedPool`) and a cache's block tables (`BlockGroup`)."""

from .block_pool import BlockPool
from .folder_blocks import FolderBlocks
from .group import BlockGroup
from .layer_pool import LayerPool
from .paged_pool import DEFAULT_BLOCK_SIZE, PagedPool
from .prefix_store import PrefixStore, PrefixStoreStats, block_hash, chain_hashes
from .quant_layer_pool import QuantLayerPool
from .redis_blocks import RedisBlocks

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockGroup",
    "BlockPool",
    "FolderBlocks",
    "LayerPool",
    "PagedPool",
    "PrefixStore",
    "PrefixStoreStats",
    "QuantLayerPool",
    "RedisBlocks",
    "block_hash",
    "chain_hashes",
]
