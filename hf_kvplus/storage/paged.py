"""Paged storage: a layer's K/V in fixed-size blocks of a shared pool, addressed through block tables."""

from __future__ import annotations

from functools import partial

import torch

from ..errors import CacheMismatchError, ConfigError
from ..kernels.dispatch import paged_store, paged_store_token
from ..memory import MemoryReport
from ..paging.group import BlockGroup, identical_rows
from ..paging.layer_pool import LayerPool
from .base import KVStorage
from .reads import PagedRead, Read, placeholders
from .token_count import TokenCount, counted


class PagedStorage(KVStorage):
    """One layer of a cache: its `LayerPool` tensors, filled through its group's block tables.

    New tokens are written through a slot mapping (`paged_store`; a decode step's one token by two
    index_put into its rows' blocks), never by concatenation; a decode step attends over the blocks
    in place (`paged_decode_attention`), so nothing gathers the sequence into a contiguous copy. Prefill and chunked
    prefill gather the visible past once (the read's `dense()`) and attend with SDPA.

    `static=True` (a group with `fixed_tokens`: every row's table reserved to that length at the first fill)
    reads all `fixed_tokens` positions every step, as StaticCache does, the model's mask hiding those not yet
    written: a decode step's shapes and block table never change, so a compiled decode never recompiles. Such a
    storage counts its tokens on the device too (`TokenCount`): a compiled step takes its write positions from
    there, so that it reads and writes no Python int and one CUDA graph serves every step (the pools are at static
    addresses, `LayerPool`). A compiled step reserves nothing (the fixed group reserved every row's blocks at the
    first fill) and checks nothing: past `fixed_tokens`, its write fails on the device, as StaticCache's does.
    """

    reads_in_place = True

    #: Other layers' block operations (copy-on-write, pool growth) write this layer's tensors while it rests.
    shared_at_rest = True

    def __init__(self, group: BlockGroup, pool: LayerPool, static: bool = False):
        if static and group.fixed_tokens is None:
            raise ConfigError("a static paged storage needs a block group of fixed_tokens: it reads that many every step")
        self.group = group
        self.pool = pool
        self.static_length = group.fixed_tokens if static else None
        self.device_count = static
        self.count = TokenCount()  # `end`; a static storage's on the device too
        self.start = self.end = 0
        self.member = group.join(self, pool.copy_blocks, pool.zero_blocks)

    def shard_heads(self, local: int) -> None:
        self.pool.shard_heads(local)

    @property
    def k_pool(self) -> torch.Tensor | None:
        return self.pool.k

    @property
    def v_pool(self) -> torch.Tensor | None:
        return self.pool.v

    end = counted("Logical tokens start..end-1 are held (`count`; a static storage's on the device too).")

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
        if self.count.tensor is not None and self.group.tables:  # static, filled: every row's blocks are reserved
            self.count.check_room(new, self.static_length)
            self._append_counted(keys, values)
            return
        if not self.group.pool.guard_writes:
            self._append(keys, values, new)
        else:  # a growable pool shared across threads may grow (new tensors) meanwhile: no write lands in the old ones
            with self.group.pool.hold():
                self._append(keys, values, new)
        if self.device_count and self.count.tensor is None:
            self.count.place(keys.device)

    def _append(self, keys: torch.Tensor, values: torch.Tensor, new: int) -> None:
        sources = identical_rows(keys) if not self.group.tables and keys.shape[0] > 1 else None
        self.group.reserve(keys.shape[0], self.end + new, sources)
        if new == 1:  # a decode step: each row's block of the token, at one offset in all of them (Python ints)
            token, bs = self.end - self.group.base, self.group.block_size
            column, offset = token // bs, token % bs  # (dynamo cannot trace divmod)
            pool = self.pool
            paged_store_token(pool.k, pool.v, keys, values, offset, self.group.table_tensor(keys.device), column)
        else:
            slots = self.group.slot_mapping(self.end, self.end + new, keys.device)
            paged_store(self.k_pool, self.v_pool, keys, values, slots, check=False)
        self.end += new

    def _append_counted(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A static storage's write after its first fill, compiled or not: at the positions counted on the device,
        through the table the fixed group reserved then (no Python int read, so one graph serves every step)."""
        new, bs = keys.shape[2], self.group.block_size
        positions = self.count.positions(new)  # (a fixed group's base is 0)
        blocks = self.group.table_tensor(keys.device)[:, positions // bs]  # [batch, new]
        offsets = positions % bs
        self.k_pool[blocks, :, offsets] = keys.transpose(1, 2)
        self.v_pool[blocks, :, offsets] = values.transpose(1, 2)
        self.count.advance(new)

    def view(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathers the last `last` tokens into dense `[batch, kv_heads, last, head_dim]` tensors."""
        return self._gather(self.end - last, self.end)

    def _gather(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical tokens `first .. end - 1` as dense `[batch, kv_heads, end - first, head_dim]` tensors."""
        last = end - first
        bs, base = self.group.block_size, self.group.base
        columns = torch.arange((first - base) // bs, -(-(end - base) // bs), device=self.k_pool.device)
        blocks = self.group.table_tensor(self.k_pool.device).long()[:, columns]
        skip = (first - base) % bs

        def gather(pool):
            batch, n = blocks.shape
            dense = pool[blocks].permute(0, 2, 1, 3, 4).reshape(batch, pool.shape[1], n * bs, pool.shape[3])
            return dense[:, :, skip : skip + last]

        return gather(self.k_pool), gather(self.v_pool)

    def read(self, last: int, new: int) -> Read:
        first = self.end - last if self.static_length is None else 0  # static: the whole table (base is 0)
        end = first + (last if self.static_length is None else self.static_length)
        pool = self.pool
        return PagedRead(
            *placeholders(self.k_pool, self.batch_size, pool.num_kv_heads, end - first, pool.head_dim, pool.head_dim),
            self.k_pool, self.v_pool, self.group.table_tensor(self.k_pool.device), first - self.group.base,
            end - first, partial(self._gather, first, end),
        )  # fmt: skip

    def note_mask(self, attention_mask: torch.Tensor, new: int) -> None:
        """Left padding of the first prefill: key columns no query attends to, from the start of each row. A one-token
        step is not such a prefill (a row of one token has no padding to free), so a compiled decode step, which reads
        no count, returns at once."""
        if new == 1 or self.start != 0 or self.end != new:  # not a first prefill, or part of it already dropped
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
        block, group = self.pool.block_bytes, self.group
        ahead = 0  # blocks a fixed group reserved past the written tokens (each row's own)
        if group.fixed_tokens is not None and group.tables:
            ahead = len(group.tables) * (len(group.tables[0]) - -(-(self.end - group.base) // group.block_size))
        first_member = group.members[0] is self
        table = group.table_tensor(self.k_pool.device)
        return MemoryReport(
            payload_bytes=(group.blocks_in_use() - ahead) * block,
            reserved_bytes=ahead * block,
            metadata_bytes=table.numel() * table.element_size() if first_member else 0,
            batch_size=self.batch_size,
        )

