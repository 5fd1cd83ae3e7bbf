"""A block group: layers that hold the same tokens share one block pool and one block table per row.

All full-attention layers of a model form one group; the sliding layers of one window form another
(they hold fewer tokens, so their blocks are freed as they leave the window). Layers write their own
K/V into their own pool tensors, at the slots the group hands out; block ids mean the same tokens in
every layer of the group, as in vLLM.

State that every layer owns (how far it has written, the oldest token it still needs) lives in its
storage; the group derives what to allocate and what to free from them, so per-layer calls
(`append`, `drop_front`, `drop_back`) need no coordination. Batch-row operations (beam reorder,
selection, fan-out) reach the group once per layer, as Transformers calls them: the first member
to bring one applies it to the shared tables, the others find it applied (the group is the one
block manager of its layers, so the cache needs no override of its own).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CacheMismatchError, CapacityError
from ..host_index import index_tensor
from .block_pool import BlockPool


class BlockGroup:
    """Block tables of one group of layers over one `BlockPool`.

    Logical token t of row b (counted from the first token the cache saw) lives in block
    `tables[b][(t - base) // block_size]` at offset `(t - base) % block_size`; `base` moves forward by
    whole blocks as windows drop their oldest tokens.

    With `fixed_tokens`, every row's table spans that many tokens from the first fill on, so the tables'
    width never changes and a decode step allocates nothing (what a compiled decode needs). The blocks past
    the written tokens are each row's own (unshared after a batch-row operation), so a step writes into them
    without copy-on-write; writing past `fixed_tokens` raises `CapacityError`. (Slots not yet written hold
    finite numbers, zeros or older tokens: the pool's tensors start at zero.)
    """

    def __init__(self, pool: BlockPool, block_size: int, fixed_tokens: int | None = None):
        self.pool = pool
        self.block_size = block_size
        self.fixed_tokens = fixed_tokens
        self.tables: list[list[int]] = []
        self.base = 0  # logical index of the first token of table column 0
        self.reserved = 0  # slots exist for logical tokens < reserved, in every row
        self.members: list = []  # the storages of the group's layers
        self._table_tensor: torch.Tensor | None = None
        self._copy_blocks: list[Callable[[list[int], list[int]], None]] = []
        self._zero_blocks: list[Callable[[list[int]], None]] = []
        self._pads: list[int] | None = None  # left padding seen by the first prefill, released at the next step
        self._ops = 0  # batch-row operations applied to the tables
        self._member_ops: list[int] = []  # how many of them each member has brought
        self._batch_before = 0  # rows before the last operation, as members that have not brought it still see

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    def join(
        self, storage, copy_blocks: Callable[[list[int], list[int]], None], zero_blocks: Callable[[list[int]], None]
    ) -> int:
        """Adds a layer's storage and returns its member number; `copy_blocks(sources, targets)` copies blocks of
        its tensors (copy-on-write), `zero_blocks(ids)` clears some."""
        self.members.append(storage)
        self._member_ops.append(self._ops)
        self._copy_blocks.append(copy_blocks)
        self._zero_blocks.append(zero_blocks)
        return len(self.members) - 1

    def note_padding(self, pads: list[int]) -> None:
        """Records each row's count of left-padding tokens, seen by the first prefill's mask.

        At the next trim (between steps: every layer has attended by then), blocks holding only padding
        are swapped for one shared zero block: the mask hides those keys, so their values never matter.
        """
        if self._pads is None and self.base == 0 and any(pad >= self.block_size for pad in pads):
            self._pads = pads

    def reserve(self, batch: int, end: int, sources: list[int] | None = None) -> None:
        """Makes slots exist for logical tokens < `end` in each of `batch` rows.

        The first layer of a step allocates; the others find the slots there. Before writing into a
        partly filled last block that other rows share (after a beam reorder or a fan-out), the row
        gets its own copy of it (copy-on-write); full blocks stay shared. On the first fill,
        `sources[row]` names an earlier row with the same tokens (beams and samples of one prompt):
        such a row shares that row's blocks instead of getting its own. A fixed group reserves its
        `fixed_tokens` at the first fill.
        """
        if self.tables and end <= self.reserved:
            return  # a later layer of this step: the first one allocated (and trimmed)
        if self.fixed_tokens is not None and end > self.fixed_tokens:
            raise CapacityError(f"{end} tokens per row do not fit in the cache's max_tokens={self.fixed_tokens}")
        self.trim()
        first_fill = not self.tables
        if first_fill:
            if sources is not None and any(src != row for row, src in enumerate(sources)):
                self._fill_shared(end, sources)
            else:
                self.tables = [[] for _ in range(batch)]
        try:
            self._extend(max(end, self.fixed_tokens or 0))
        except CapacityError:
            if first_fill:
                self.reset()  # all or nothing: a failed first fill leaves no blocks taken
            raise

    def _extend(self, end: int) -> None:
        if end <= self.reserved:
            return
        bs = self.block_size
        if (self.reserved - self.base) % bs:
            self._unshare([(self.reserved - self.base) // bs])
        needed_columns = -(-(end - self.base) // bs)
        new_per_row = needed_columns - len(self.tables[0])
        if new_per_row > 0:
            ids = self.pool.allocate(new_per_row * len(self.tables))
            for row, table in enumerate(self.tables):
                table.extend(ids[row * new_per_row : (row + 1) * new_per_row])
            self._table_tensor = None  # (a step within the last block keeps the tensor)
        self.reserved = end

    def attach(self, blocks: list[int]) -> None:
        """Starts the empty group's one row with `blocks` (a stored prefix, referenced for this group): every
        member then holds their tokens."""
        self.tables, self.reserved = [list(blocks)], len(blocks) * self.block_size
        self._table_tensor = None
        for member in self.members:
            member.attached(self.reserved)

    def _fill_shared(self, end: int, sources: list[int]) -> None:
        unique = sorted(set(sources))
        columns = -(-(end - self.base) // self.block_size)
        ids = self.pool.allocate(columns * len(unique))
        own = {row: ids[i * columns : (i + 1) * columns] for i, row in enumerate(unique)}
        self.tables = []
        for row, src in enumerate(sources):
            if row != src:
                self.pool.incref(own[src])
            self.tables.append(list(own[src]))
        self.reserved = end
        self._table_tensor = None

    def slot_mapping(self, begin: int, end: int, device: torch.device) -> torch.Tensor:
        """`[batch, end - begin]` pool slots (block id x block_size + offset) of logical tokens begin..end-1."""
        offsets = torch.arange(begin - self.base, end - self.base, device=device)
        table = self.table_tensor(device).long()
        blocks = table[:, offsets // self.block_size]
        return blocks * self.block_size + offsets % self.block_size

    def table_tensor(self, device: torch.device) -> torch.Tensor:
        """The block tables as an int32 `[batch, columns]` tensor (cached until the tables change)."""
        if self._table_tensor is None or self._table_tensor.device != device:
            self._table_tensor = index_tensor(self.tables, device, torch.int32)
        return self._table_tensor

    def trim(self) -> None:
        """Frees whole blocks no layer needs any more: before the oldest token still held, after the newest,
        and blocks of left padding. Called between steps only (at the next allocation, crop, reports)."""
        if not self.tables or len(self.tables[0]) == 0 and self.reserved == 0:
            return
        if self._pads is not None:
            self._release_padding()
        first = min(m.start for m in self.members)
        last = max(m.end for m in self.members)
        if last == 0:
            self.reset()
            return
        bs, columns = self.block_size, len(self.tables[0])
        while self.base + bs <= first and self.tables[0]:
            self._free_column(0)
            self.base += bs
        last = max(last, self.fixed_tokens or 0)
        keep = -(-(last - self.base) // bs)
        while len(self.tables[0]) > keep:
            self._free_column(len(self.tables[0]) - 1)
        self.reserved = min(last, self.base + len(self.tables[0]) * bs)
        if len(self.tables[0]) != columns:
            self._table_tensor = None

    def rows_of(self, member: int) -> int:
        """Batch rows as member `member` sees them: before a batch-row operation other members already applied."""
        return self.batch_size if self._member_ops[member] == self._ops else self._batch_before

    def index_batch(self, member: int, indices: torch.Tensor) -> None:
        """Member `member`'s layer keeps batch rows `indices` (repeats allowed). The first member to bring an
        operation applies it: tables are copied, blocks shared, not copied. Each member brings each one once."""
        behind = self._ops - self._member_ops[member]
        if behind == 0:
            self._batch_before = self.batch_size
            self._apply(indices.tolist())
            self._ops += 1
        elif behind != 1:
            raise CacheMismatchError(
                f"a batch-row operation reached layer member {member} of a block group whose other layers are "
                f"{behind} operations ahead: call it on every layer, in turn"
            )
        self._member_ops[member] = self._ops

    def _apply(self, indices: list[int]) -> None:
        if not self.tables:
            return
        new_tables = [list(self.tables[i]) for i in indices]
        for table in new_tables:
            self.pool.incref(table)
        for table in self.tables:
            self.pool.decref(table)
        self.tables = new_tables
        self._table_tensor = None
        if self.fixed_tokens is not None:  # the blocks ahead are written without a reserve: each row's own now
            written = max(member.end for member in self.members)
            self._unshare(range((written - self.base) // self.block_size, len(self.tables[0])))

    def reset(self, collected: bool = False) -> None:
        """Drops every table's blocks; `collected`: from a collected cache's finalizer (`BlockPool.release`, safe on
        any thread and in the middle of a pool operation)."""
        ids = [block for table in self.tables for block in table]
        (self.pool.release if collected else self.pool.decref)(ids)
        self.tables = []
        self._pads = None
        self.base = self.reserved = 0
        self._table_tensor = None

    def blocks_in_use(self, end: int | None = None) -> int:
        """Distinct blocks the tables reference (shared blocks count once); with `end`, those holding tokens before
        logical token `end` only (a member that holds fewer tokens than another: a quantized layer beside a
        full-precision boundary layer, whose window tokens are in blocks too)."""
        columns = None if end is None else -(-(end - self.base) // self.block_size)
        return len({block for table in self.tables for block in table[:columns]})

    def _release_padding(self) -> None:
        pads, self._pads = self._pads, None
        full_columns = [pad // self.block_size for pad in pads]
        shared = None
        for table, columns in zip(self.tables, full_columns, strict=True):
            for column in range(min(columns, len(table))):
                self.pool.decref([table[column]])  # first: a pool the prefill filled takes the zero block from it
                if shared is None:
                    (shared,) = self.pool.allocate(1)
                    self._clear([shared])
                else:
                    self.pool.incref([shared])
                table[column] = shared
        self._table_tensor = None

    def _clear(self, ids: list[int]) -> None:
        with self.pool.hold():  # (a pool shared across threads grows under its lock: not while this writes)
            for zero_blocks in self._zero_blocks:
                zero_blocks(ids)

    def _free_column(self, column: int) -> None:
        self.pool.decref([table.pop(column) for table in self.tables])

    def _unshare(self, columns) -> None:
        """Gives each row its own copy of its blocks in `columns` that other rows (or the prefix store) share.

        The copies run at the end, in one indexed copy per tensor; a pool that runs out midway raises after the
        blocks already swapped in got theirs, so every table still names blocks holding its tokens."""
        sources, targets = [], []
        try:
            for column in columns:
                for table in self.tables:
                    if column < len(table) and self.pool.refcount(table[column]) > 1:
                        (fresh,) = self.pool.allocate(1)
                        sources.append(table[column])
                        targets.append(fresh)
                        self.pool.decref([table[column]])
                        table[column] = fresh
        finally:
            if targets:
                with self.pool.hold():  # (as `_clear`)
                    for copy_blocks in self._copy_blocks:
                        copy_blocks(sources, targets)
                self._table_tensor = None


def identical_rows(keys: torch.Tensor) -> list[int]:
    """For each batch row of `keys`, the first row with the same keys (rows of one prompt: beams, samples).

    Compares values, so the host waits for the device: called on a prompt's first fill only.
    """
    sources = []
    for row in range(keys.shape[0]):
        sources.append(next(src for src in range(row + 1) if src == row or torch.equal(keys[src], keys[row])))
    return sources
