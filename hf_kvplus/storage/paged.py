"""Paged storage: a layer's K/V in fixed-size blocks of a shared pool, addressed through block tables."""

from __future__ import annotations

from functools import partial

import torch

from ..errors import CacheMismatchError
from ..kernels.paged_attention import paged_store
from ..memory import MemoryReport
from ..paging.group import BlockGroup, identical_rows
from ..paging.layer_pool import LayerPool
from .base import KVStorage
from .reads import DenseRead, PagedRead, Read, placeholders


class PagedStorage(KVStorage):
    """One layer of a cache: its `LayerPool` tensors, filled through its group's block tables.

    New tokens are written through a slot mapping (`paged_store`; a decode step's one token by two
    index_put into its rows' blocks), never by concatenation; a decode step attends over the blocks
    in place (`paged_decode_attention`), so nothing gathers the sequence into a contiguous copy. Prefill and chunked prefill gather the visible past once and attend with
    SDPA. With `fused=False` (a model on eager or another attention function) `update` returns
    gathered dense K/V on every step instead.
    """

    #: Other layers' block operations (copy-on-write, pool growth) write this layer's tensors while it rests.
    shared_at_rest = True

    def __init__(self, group: BlockGroup, pool: LayerPool, fused: bool = True):
        self.group = group
        self.pool = pool
        self.fused = fused
        self.start = self.end = 0  # logical tokens held: start..end-1
        self.member = group.join(self, pool.copy_block, pool.zero_block)

    @property
    def k_pool(self) -> torch.Tensor | None:
        return self.pool.k

    @property
    def v_pool(self) -> torch.Tensor | None:
        return self.pool.v

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def batch_size(self) -> int:
        return self.group.rows_of(self.member)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.pool.ensure(keys, values)
        if self.group.tables and keys.shape[0] != self.group.batch_size:
            raise CacheMismatchError(f"new keys have batch {keys.shape[0]}, the cache holds {self.group.batch_size} rows")
        new = keys.shape[2]
        sources = identical_rows(keys) if not self.group.tables and keys.shape[0] > 1 else None
        self.group.reserve(keys.shape[0], self.end + new, sources)
        if new == 1:  # a decode step: each row's block of the token, at one offset (a Python int) in all of them
            token, bs = self.end - self.group.base, self.group.block_size
            column, offset = token // bs, token % bs  # (dynamo cannot trace divmod)
            blocks = self.group.table_tensor(keys.device)[:, column]
            self.k_pool[blocks, :, offset] = keys[:, :, 0]
            self.v_pool[blocks, :, offset] = values[:, :, 0]
        else:
            slots = self.group.slot_mapping(self.end, self.end + new, keys.device)
            paged_store(self.k_pool, self.v_pool, keys, values, slots, check=False)
        self.end += new

    def view(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathers the last `last` tokens into dense `[batch, kv_heads, last, head_dim]` tensors."""
        first = self.end - last
        bs, base = self.group.block_size, self.group.base
        columns = torch.arange((first - base) // bs, -(-(self.end - base) // bs), device=self.k_pool.device)
        blocks = self.group.table_tensor(self.k_pool.device).long()[:, columns]
        skip = (first - base) % bs

        def gather(pool):
            batch, n = blocks.shape
            dense = pool[blocks].permute(0, 2, 1, 3, 4).reshape(batch, pool.shape[1], n * bs, pool.shape[3])
            return dense[:, :, skip : skip + last]

        return gather(self.k_pool), gather(self.v_pool)

    def read(self, last: int, new: int) -> Read:
        if not (self.fused and new == 1):
            return DenseRead(*self.view(last))
        pool = self.pool
        return PagedRead(
            *placeholders(self.k_pool, self.batch_size, pool.num_kv_heads, last, pool.head_dim, pool.head_dim),
            self.k_pool, self.v_pool, self.group.table_tensor(self.k_pool.device), self.end - last - self.group.base,
            last, partial(self.view, last),
        )  # fmt: skip

    def note_mask(self, attention_mask: torch.Tensor, new: int) -> None:
        """Left padding of the first prefill: key columns no query attends to, from the start of each row."""
        if self.start != 0 or self.end != new:  # not a first prefill, or part of it already dropped
            return
        if attention_mask.dtype != torch.bool or attention_mask.ndim != 4 or attention_mask.shape[0] != self.batch_size:
            return
        attended = attention_mask[:, 0].any(dim=1)  # [batch, kv]
        pads = torch.where(attended.any(dim=1), attended.int().argmax(dim=1), attended.shape[1])
        self.group.note_padding(pads.tolist())

    def attached(self, tokens: int) -> None:
        """The group's tables now start with `tokens` tokens of stored blocks: this layer holds them."""
        self.end = tokens

    def drop_front(self, count: int) -> None:
        # The blocks are freed at the group's next allocation (or trim): the layers of this step still
        # attend to tokens the retention drops as soon as it has built `update`'s return value.
        self.start += count

    def drop_back(self, count: int) -> None:
        self.end -= count
        self.start = min(self.start, self.end)
        self.group.trim()

    def index_batch(self, indices: torch.Tensor) -> None:
        self.group.index_batch(self.member, indices)

    def reset(self) -> None:
        self.start = self.end = 0
        self.group.trim()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's block tensors (the block tables are the group's and stay where they are)."""
        return self.pool.tensors()

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pool.load_tensors(tensors)

    def memory(self) -> MemoryReport:
        if self.k_pool is None:
            return MemoryReport()
        block = self.pool.block_bytes
        used = self.group.blocks_in_use()
        first_member = self.group.members[0] is self
        table = self.group.table_tensor(self.k_pool.device)
        return MemoryReport(
            payload_bytes=used * block,
            reserved_bytes=0,
            metadata_bytes=table.numel() * table.element_size() if first_member else 0,
            batch_size=self.batch_size,
        )

