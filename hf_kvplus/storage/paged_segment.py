"""A quantized segment in paged blocks: a block that fills is quantized once into a block of a shared pool."""

from __future__ import annotations

import torch

from ..errors import CacheMismatchError, ShapeError
from ..host_index import index_tensor
from ..memory import MemoryReport, tensor_bytes
from ..paging.group import BlockGroup
from ..paging.quant_layer_pool import QuantLayerPool
from .quantized import QuantizedSegment
from .reads import Read, quantized_read


class PagedSegment(QuantizedSegment):
    """The quantized tokens of one layer in blocks of a `QuantLayerPool`, addressed through its group's tables.

    The segment holds logical tokens `start .. end - 1` of the group (a segment's tokens are the oldest of the
    sequence, counted from the first one it ever quantized); block ids mean the same tokens in every layer of the
    group. Its `unit` is the block size: the `QuantizedStorage` above it flushes whole blocks out of its
    full-precision window, so every block is full when it is written and is quantized exactly once ("a paged block
    that fills becomes a quantized block"). Nothing is ever written into a shared block, so beams and fanned-out rows
    share quantized blocks without copy-on-write.

    Decode attends over the blocks in place (`quantized_decode_attention` with the group's block table) followed by
    the full-precision window; prefill gathers and dequantizes the blocks it needs (`dequantized`).

    Batch-row operations change the group's shared tables: the cache calls `BlockGroup.index_batch` once per group
    (and indexes every layer's full-precision window); `index_batch` here does the group's part for a segment used
    on its own.
    """

    #: Other layers' block operations (copy-on-write, pool growth) write this layer's tensors while it rests.
    shared_at_rest = True
    shares_rows = True

    def __init__(self, group: BlockGroup, pool: QuantLayerPool):
        self.group = group
        self.pool = pool
        self.fmt, self.state = pool.fmt, pool.state  # (the pool's: its caches and prefix store share the state)
        self.start = self.end = 0  # logical tokens held: start..end-1 (BlockGroup.trim reads them)
        self.member = group.join(self, pool.copy_blocks, pool.zero_blocks)

    def shard_heads(self, local: int) -> None:
        self.pool.shard_heads(local)

    @property
    def unit(self) -> int:
        return self.group.block_size

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def front_offset(self) -> int:
        return self.start % self.group.block_size  # blocks start at logical multiples of the block size

    @property
    def batch_size(self) -> int:
        return self.group.rows_of(self.member)

    def append(self, keys: torch.Tensor, values: torch.Tensor, same_rows: list[int] | None = None) -> None:
        batch, _, n, _ = keys.shape
        bs, group = self.group.block_size, self.group
        if n % bs:
            raise ShapeError(f"a paged segment appends whole blocks of {bs} tokens, got {n}")
        if group.tables and batch != group.batch_size:
            raise CacheMismatchError(f"new keys have batch {batch}, the cache holds {group.batch_size} rows")
        self.pool.ensure(keys, values)
        self.dtype = keys.dtype
        with group.pool.hold():  # (once per block: a growing pool, shared across threads, replaces its tensors)
            self._write(keys, values, same_rows)
        self.end += n

    def _write(self, keys: torch.Tensor, values: torch.Tensor, same_rows: list[int] | None) -> None:
        batch, n, bs, group = keys.shape[0], keys.shape[2], self.group.block_size, self.group
        group.reserve(batch, self.end + n, same_rows if not group.tables else None)
        first = (self.end - group.base) // bs
        ids = [block for table in group.tables for block in table[first : first + n // bs]]  # row-major
        k_blocks, v_blocks = _blocks(keys, bs), _blocks(values, bs)
        unique = _first_occurrences(ids)
        if unique is not None:  # rows sharing blocks (one prompt's beams): write each block once
            index = index_tensor(unique, keys.device)
            ids, k_blocks, v_blocks = [ids[i] for i in unique], k_blocks[index], v_blocks[index]
        self.pool.write(index_tensor(ids, keys.device), k_blocks, v_blocks)

    def begin_update(self) -> None:
        if self.member == 0:  # the group's first layer: the last forward has passed every layer of the group
            self.group.trim()

    def dequantized(self, first: int, last: int, dtype: torch.dtype | None = None):
        dtype = dtype or self.dtype
        bs, base = self.group.block_size, self.group.base
        lo, hi = self.start + first - base, self.start + last - base
        if hi <= lo:
            shape = (self.batch_size, self.pool.num_kv_heads, 0)
            device = self.pool.k.device
            v_dim = self.pool.v_scale.shape[-1] * self.fmt.group_size
            return (
                torch.empty(*shape, self.pool.head_dim, dtype=dtype, device=device),
                torch.empty(*shape, v_dim, dtype=dtype, device=device),
            )
        c0, c1 = lo // bs, -(-hi // bs)
        ids = self.group.table_tensor(self.pool.k.device)[:, c0:c1].long()
        k, v = self.pool.dequantized(ids, dtype)
        skip = lo - c0 * bs
        return k[:, :, skip : skip + hi - lo], v[:, :, skip : skip + hi - lo]

    def read(self, first, count, recent_k, recent_v, dense) -> Read:
        return quantized_read(
            self.pool.packed, self.fmt, self.start + first - self.group.base, count, recent_k, recent_v,
            self.group.table_tensor(recent_k.device), dense, self.state,
        )  # fmt: skip

    def attached(self, tokens: int) -> None:
        """The group's tables now start with `tokens` tokens of stored blocks: this layer holds them."""
        self.end = tokens

    def drop_front(self, count: int) -> None:
        # Lazy: the layers of this step still attend to these tokens; the group frees whole blocks no layer needs
        # at its next trim (the next allocation, the cache's next step, a report).
        self.start += count

    def truncate(self, keep: int) -> None:
        self.end = self.start + keep
        self.group.trim()

    def index_batch(self, indices: torch.Tensor) -> None:
        self.group.index_batch(self.member, indices)

    def reset(self) -> None:
        self.start = self.end = 0
        self.group.trim()

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.pool.tensors()

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pool.load_tensors(tensors)

    def quantized_part(self) -> tuple[MemoryReport, int]:
        """The blocks holding this layer's coded tokens (shared blocks once; the tables are no codes) as one row of
        their token slots."""
        if self.pool.k is None or not self.group.tables:
            return MemoryReport(), 0
        blocks = self.group.blocks_in_use(self.end)
        report = MemoryReport(
            payload_bytes=blocks * self.pool.code_bytes, metadata_bytes=blocks * self.pool.param_bytes, batch_size=1
        )
        return report, blocks * self.group.block_size

    def memory(self) -> MemoryReport:
        """Codes of the blocks the group's tables reference (shared blocks once) as payload; their scales and zero
        points, the layer's format state (a key centre the pool's caches share) and, for the group's first layer, the
        block tables, as metadata."""
        if self.pool.k is None or not self.group.tables:
            return MemoryReport()
        used = self.group.blocks_in_use()
        metadata = tensor_bytes(list(self.fmt.state_tensors(self.state)))
        if self.group.members[0] is self:
            table = self.group.table_tensor(self.pool.k.device)
            metadata += table.numel() * table.element_size()
        return MemoryReport(
            payload_bytes=used * self.pool.code_bytes,
            metadata_bytes=used * self.pool.param_bytes + metadata,
            batch_size=self.batch_size,
        )


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[batch, heads, n, dim]` as `[batch * n / block_size, heads, block_size, dim]`, row-major over (row, block)."""
    batch, heads, n, dim = x.shape
    return x.reshape(batch, heads, n // block_size, block_size, dim).transpose(1, 2).reshape(-1, heads, block_size, dim)


def _first_occurrences(ids: list[int]) -> list[int] | None:
    """Positions of the first occurrence of each id, or None when no id repeats."""
    seen: set[int] = set()
    first = [i for i, block in enumerate(ids) if not (block in seen or seen.add(block))]
    return None if len(first) == len(ids) else first
