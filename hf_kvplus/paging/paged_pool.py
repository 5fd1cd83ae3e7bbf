"""Block pools and layer tensors of a model, shared by the PagedCaches built on them."""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedConfig

from ..errors import CacheMismatchError, ConfigError
from ..fingerprint import digest, fingerprint
from ..formats import layer_state, resolve_format
from ..kernels.paged_attention import DEFAULT_BLOCK_SIZE
from ..kernels.quant_format import QuantFormat
from ..kernels.rotated_format import RotatedFormat
from ..model_spec import LayerSpec, ModelSpec
from .block_pool import BlockPool
from .folder_blocks import FolderBlocks
from .layer_pool import LayerPool
from .persistent_tier import PersistentTier
from .prefix_store import PrefixStore
from .quant_layer_pool import QuantLayerPool, check_block_size

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

    `bits` (8, 4, 2 or "fp8"; "int4"... also accepted) makes a quantized pool: each layer's blocks are a
    `QuantLayerPool` of codes and float16 group scales (`group_size`, default as `QuantizedCache`: the format's
    default group, reduced to divide every head_dim), and a `max_bytes` budget counts quantized blocks. The block
    size must be a multiple of the group size; by default it is `DEFAULT_BLOCK_SIZE`, or the group size if larger.
    Caches on a pool use its format (`format`, None for full precision).

    `layer_bits` ({layer index: bits}) holds those layers in other formats than `bits` (None: full-precision blocks, in
    the same block groups), in groups of `group_size` too (a block holds whole groups): a quantized cache's boundary
    layers (`PrecisionRegions`). `layer_formats` gives each layer's format.

    `key_scale` (a `key_scale.KeyScale`, checked against the config; None: none): a rotated format's keys coded
    times a per-pair scale, as `QuantizedCache`'s, held in each layer's state, so every cache on the pool and its
    prefix store code and read with it. A `PagedCache` building its own pool gives it the model's
    (`fitted.key_scale_for`); a pool built to share takes `key_scale=fitted.key_scale_for(config)` for the same.

    `prefix_backend` keeps the prefix store's blocks beyond the process (`persistent_tier`): a folder (a path, or
    `FolderBlocks(path, max_bytes=...)` to bound it) or `RedisBlocks(url)`. Every pool opened on it with the same
    model, block size, formats and `dtype` (default the config's, else float32) reads the blocks the others stored.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
        max_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        bits: int | str | None = None,
        group_size: int | None = None,
        layer_bits: dict[int, int | str | None] | None = None,
        prefix_backend=None,
        key_scale=None,
    ):
        self.model_spec = ModelSpec.from_config(config)
        self.format = resolve_format(self.model_spec, bits, group_size)
        layer_bits = layer_bits or {}
        if layer_bits and self.format is None:
            raise ConfigError(f"layer_bits={layer_bits} needs bits: a full-precision pool holds every layer exact")
        #: Each layer's block format (None: full precision).
        self.layer_formats: dict[int, QuantFormat | None] = {
            spec.index: self._layer_format(layer_bits[spec.index], group_size) if spec.index in layer_bits
            else self.format
            for spec in self.model_spec.layers if spec.holds_kv
        }  # fmt: skip
        #: The keys' scale (`KeyScale`) where a layer's blocks are in a rotated format, or None.
        #: Whether some layer's blocks are in a rotated format (whose keys a scale codes).
        self.rotated = any(isinstance(fmt, RotatedFormat) for fmt in self.layer_formats.values())
        if key_scale is not None:
            key_scale.check(config)
        #: The keys' scale (`key_scale.KeyScale`) of the rotated layers, or None.
        self.key_scale = key_scale if self.rotated else None
        if block_size is None:
            block_size = DEFAULT_BLOCK_SIZE if self.format is None else max(DEFAULT_BLOCK_SIZE, self.format.group_size)
        if (
            isinstance(block_size, bool) or not isinstance(block_size, int)
            or block_size < 8 or block_size > 128 or block_size & (block_size - 1)
        ):
            raise ConfigError(f"block_size must be a power of two in 8..128, got {block_size}")
        for fmt in {fmt for fmt in self.layer_formats.values() if fmt is not None}:
            check_block_size(block_size, fmt)
        if num_blocks is not None and num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1 (or None to grow on demand), got {num_blocks}")
        self.block_size = block_size
        if num_blocks is not None and max_bytes is not None:
            raise ConfigError(f"give num_blocks ({num_blocks}) or max_bytes ({max_bytes}), not both")
        if max_bytes is not None:
            budgets = self._blocks_for_budget(config, block_size, max_bytes, dtype)
        self.blocks: dict[str, BlockPool] = {}
        self.layers: dict[int, LayerPool | QuantLayerPool] = {}
        for spec in self.model_spec.layers:
            if not spec.holds_kv:
                continue
            key = group_key(spec)
            if key not in self.blocks:
                fixed = budgets[key] if max_bytes is not None else num_blocks
                self.blocks[key] = BlockPool(fixed, initial=GROWABLE_INITIAL_BLOCKS)
            fmt = self.layer_formats[spec.index]
            if fmt is None:
                self.layers[spec.index] = LayerPool(self.blocks[key], block_size, spec.num_kv_heads, spec.head_dim)
            else:
                self.layers[spec.index] = QuantLayerPool(
                    self.blocks[key], block_size, spec.num_kv_heads, spec.head_dim, fmt.for_layer(spec.index),
                    layer_state(fmt, spec.index, self.key_scale),
                )
        only_full = set(self.blocks) == {"full"}
        if prefix_backend is not None and not only_full:
            raise ConfigError(
                f"prefix_backend needs a model whose layers are all full attention; this one has layer groups "
                f"{sorted(self.blocks)}"
            )
        tier = self._tier(config, prefix_backend, dtype) if prefix_backend is not None else None
        self.prefix_store = PrefixStore(self.blocks["full"], block_size, tier=tier) if only_full else None

    def _tier(self, config, backend, dtype) -> PersistentTier:
        """The prefix store's persistent tier on `backend`, scoped to what this pool's blocks hold."""
        if isinstance(backend, (str, os.PathLike)):
            backend = FolderBlocks(backend)
        dtype = _dtype(dtype or getattr(config, "dtype", None) or torch.float32)
        held = {
            "model": fingerprint(config), "block_size": self.block_size, "dtype": str(dtype),
            "formats": {str(i): None if fmt is None else str(fmt) for i, fmt in self.layer_formats.items()},
        }  # fmt: skip
        if self.key_scale is not None:  # (scaled keys' codes are other codes; unscaled pools keep their scope)
            held["key_scale"] = self.key_scale.digest()
        scope = digest(held)
        layers = {i: self.layers[i] for i in sorted(self.layers)}
        return PersistentTier(backend, scope, self.blocks["full"], layers, dtype)

    def _blocks_for_budget(self, config, block_size: int, max_bytes: int, dtype) -> dict[str, int]:
        dtype = _dtype(dtype or getattr(config, "dtype", None) or torch.float32)
        layers: dict[str, list[LayerSpec]] = {}
        for spec in self.model_spec.layers:
            if spec.holds_kv:
                layers.setdefault(group_key(spec), []).append(spec)
        total = sum(len(group) for group in layers.values())
        budgets = {}
        for key, group in layers.items():
            block_bytes = sum(
                2 * s.num_kv_heads * block_size * s.head_dim * dtype.itemsize if self.layer_formats[s.index] is None
                else QuantLayerPool.bytes_per_block(self.layer_formats[s.index], block_size, s.num_kv_heads, s.head_dim)
                for s in group
            )  # fmt: skip
            held_as = f"in {dtype}" if self.format is None else f"quantized {self.format}"
            budgets[key] = max_bytes * len(group) // total // block_bytes
            if budgets[key] < 1:
                raise ConfigError(
                    f"max_bytes {max_bytes:,} leaves {max_bytes * len(group) // total:,} bytes for the {key} layers, "
                    f"less than one block of {block_bytes:,} bytes ({len(group)} layers x {block_size} tokens {held_as})"
                )
        return budgets

    def _layer_format(self, bits: int | str | None, group_size: int | None) -> QuantFormat | None:
        return None if bits is None else resolve_format(self.model_spec, bits, group_size)

    def check_layer_formats(self, formats: dict[int, QuantFormat | None]) -> None:
        """A cache with boundary layers needs a pool that holds them in their formats."""
        if formats != self.layer_formats:
            differ = sorted(i for i in formats if formats[i] != self.layer_formats.get(i))
            raise CacheMismatchError(
                f"this PagedPool holds layers {differ} in {[str(self.layer_formats.get(i)) for i in differ]}; the cache "
                f"asks for {[str(formats[i]) for i in differ]} (None: full precision): build the pool with the same "
                "layer_bits"
            )

    def check_format(self, fmt: QuantFormat | None) -> None:
        """A pool holds blocks in one format: caches on it must ask for that one."""
        if fmt != self.format:
            have = "full precision" if self.format is None else str(self.format)
            want = "full precision" if fmt is None else str(fmt)
            raise CacheMismatchError(
                f"this PagedPool holds {have} blocks; the cache asks for {want} (build the pool with the same "
                "bits/group_size, or leave them out of the cache to use the pool's)"
            )

    def check_model(self, spec: ModelSpec) -> None:
        """A pool serves caches of the model it was built for, no other."""
        if spec != self.model_spec:
            raise CacheMismatchError(
                f"this PagedPool was built for a {self.model_spec.model_type} with {self.model_spec.num_layers} layers; "
                f"the cache is for a {spec.model_type} with {spec.num_layers} layers"
            )


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype
