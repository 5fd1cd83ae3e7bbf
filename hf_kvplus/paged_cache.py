"""PagedCache: K/V in fixed-size blocks with block tables, shared copy-on-write between rows."""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from transformers import PreTrainedConfig

from .cache import KVCache
from .errors import ConfigError, UnsupportedOperationError
from .layer import KVLayer
from .memory import MemoryReport
from .model_spec import LayerSpec, ModelSpec
from .paging.block_pool import BlockPool
from .paging.group import BlockGroup
from .paging.paged_pool import DEFAULT_BLOCK_SIZE, PagedPool, group_key
from .storage.paged import PagedStorage

FUSED_ATTENTION = ("sdpa", "kvplus")


class PagedCache(KVCache):
    """A lossless cache whose layers hold K/V in blocks of a `PagedPool`, through per-row block tables.

    Layers that hold the same tokens (all full layers; the sliding layers of one window) share one
    table per row, so block ids mean the same tokens in each of them. Beam search's reorder,
    `batch_repeat_interleave` and `batch_select_indices` permute or copy tables and share blocks with
    reference counts; a row that writes into a shared, partly filled block first gets its own copy.
    Sliding-window layers free blocks that left their window.

    Without `pool`, the cache builds its own (`block_size`; `num_blocks` or a `max_bytes` budget fix it,
    by default it grows on demand; a fixed pool that runs out raises `CapacityError` naming the blocks needed and free, and the cache
    stays as it was). Pass a `PagedPool` to share blocks with other caches of the same model, and to
    reuse prompt prefixes across calls under a `namespace` (tenant, adapter...): blocks stored under
    one namespace are never served to another.

    >>> pool = PagedPool(model.config)                       # once per model
    >>> cache = PagedCache(config=model.config, pool=pool, namespace="tenant-a")
    >>> cache.reuse_prefix(input_ids)                        # attach stored blocks of the prompt's prefix
    >>> out = model.generate(input_ids, past_key_values=cache)  # prefills only the rest
    >>> cache.store_prefix(input_ids)                        # offer the prompt's full blocks to later calls

    A released cache gives its blocks back to the pool (the prefix store keeps the ones it holds).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        pool: PagedPool | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        max_bytes: int | None = None,
        namespace: str = "default",
    ):
        if not isinstance(namespace, str):
            raise ConfigError(f"namespace must be a str, got {type(namespace).__name__}")
        self.namespace = namespace
        self._owns_pool = pool is None
        self.pool = pool or PagedPool(config, block_size=block_size, num_blocks=num_blocks, max_bytes=max_bytes)
        self.pool.check_model(ModelSpec.from_config(config))
        self.groups: dict[str, BlockGroup] = {}
        fused = getattr(config, "_attn_implementation", None) in FUSED_ATTENTION

        def storage(spec: LayerSpec) -> PagedStorage:
            key = group_key(spec)
            if key not in self.groups:
                self.groups[key] = BlockGroup(self.pool.blocks[key], self.pool.block_size)
            return PagedStorage(self.groups[key], self.pool.layers[spec.index], fused=fused)

        super().__init__(config, storage=storage)
        weakref.finalize(self, _release, list(self.groups.values()))

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch([int(i) for i in beam_idx])

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = next(iter(self.groups.values())).batch_size
        self._index_batch([row for row in range(batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._index_batch([int(i) for i in indices])

    def _index_batch(self, rows: list[int]) -> None:
        for group in self.groups.values():
            group.index_batch(rows)

    def reuse_prefix(self, input_ids) -> int:
        """Attaches the stored blocks of the longest stored prefix of `input_ids` (one prompt) to this
        empty cache; returns how many tokens `generate` will not prefill (at least one is left)."""
        ids, store = self._prompt(input_ids), self._store()
        if any(group.tables for group in self.groups.values()):
            raise UnsupportedOperationError(
                f"reuse_prefix needs an empty cache; this one holds {self.get_seq_length()} tokens"
            )
        blocks = store.lookup(ids[:-1], self.namespace)
        reused = len(blocks) * self.block_size
        if reused:
            group = self.groups["full"]
            group.tables, group.reserved = [blocks], reused
            group._table_tensor = None
            for layer in self.layers:
                if isinstance(layer, KVLayer):
                    layer.seen = layer.storage.end = reused
        return reused

    def store_prefix(self, input_ids) -> int:
        """Offers the full blocks this cache holds of the prompt `input_ids` (row 0) to later calls in
        the same namespace; returns how many blocks were newly stored."""
        ids, store = self._prompt(input_ids), self._store()
        group = self.groups["full"]
        held = min(len(ids), min(member.end for member in group.members))
        full = held // self.block_size
        if not full or group.base:
            return 0
        return store.insert(ids[: full * self.block_size], group.tables[0][:full], self.namespace)

    def _store(self):
        if self.pool.prefix_store is None:
            raise UnsupportedOperationError(
                f"prefix reuse needs a model whose layers are all full attention; this one has layer groups "
                f"{sorted(self.groups)}"
            )
        return self.pool.prefix_store

    @staticmethod
    def _prompt(input_ids) -> list[int]:
        ids = torch.as_tensor(input_ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1:
            raise ConfigError(f"prefix reuse takes one prompt, [N] or [1, N] token ids; got shape {tuple(ids.shape)}")
        return ids.tolist()

    def memory_report(self) -> MemoryReport:
        """Blocks this cache references (shared ones once); with a pool of its own, also the free blocks."""
        for group in self.groups.values():
            group.trim()  # between steps: free what windows dropped during the last one
        report = super().memory_report()
        if not self._owns_pool:
            return report
        free = sum(
            (layer.blocks.capacity - layer.blocks.num_used) * layer.block_bytes for layer in self.pool.layers.values()
        )
        return replace(report, reserved_bytes=report.reserved_bytes + free)

    def block_pools(self) -> dict[str, BlockPool]:
        """The block pool of each layer group ("full", "sliding:512", ...)."""
        return {key: group.pool for key, group in self.groups.items()}


def _release(groups: list[BlockGroup]) -> None:
    """Gives a collected cache's blocks back to their pools."""
    for group in groups:
        group.reset()
