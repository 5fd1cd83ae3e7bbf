"""Slot storage for evicting layers: every (batch row, KV head) keeps its own set of tokens.

Evicting caches keep different tokens per KV head (H2O, SnapKV), so tokens live in slots: slot j of
row b, head h holds one token's key and value, its logical position (`pos`, -1 for a padding slot)
and its accumulated attention mass (`score`). Attention reads the slots with a mask built from `pos`,
so slot order does not matter to it; compaction keeps slots in position order anyway (padding
first), which keeps padding slots at the same indices in every head of a row.
"""

from __future__ import annotations

import torch

from ..errors import CacheMismatchError
from ..memory import MemoryReport
from ..storage.dense import _grown

#: `pos` of a slot holding a padding token.
PAD = -1


class SlotStore:
    """K/V `[batch, kv_heads, capacity, head_dim]` with per-slot positions and scores; `length` slots used."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.score: torch.Tensor | None = None
        self.length = 0

    @property
    def batch_size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> None:
        """Writes `new` tokens at logical positions `first_pos ..` into slots `length ..`."""
        new = keys.shape[2]
        if self.keys is None:
            self._allocate(keys, values, _grown(new))
        else:
            self._check_compatible(keys, values)
            if self.length + new > self.capacity:
                self._resize(_grown(self.length + new))
        end = self.length + new
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.pos[:, :, self.length : end] = torch.arange(first_pos, first_pos + new, device=self.pos.device)
        self.score[:, :, self.length : end] = 0.0
        self.length = end

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self.pos[:, :, : self.length]

    @property
    def scores(self) -> torch.Tensor:
        return self.score[:, :, : self.length]

    def mark_padding(self, padding: torch.Tensor) -> None:
        """Marks the last `padding.shape[1]` slots of each row as padding where `padding` [batch, new] is True."""
        new = padding.shape[1]
        tail = self.pos[:, :, self.length - new : self.length]
        tail.masked_fill_(padding[:, None, :].to(tail.device), PAD)

    def keep(self, slots: torch.Tensor) -> None:
        """Keeps slots `slots` [batch, kv_heads, kept] of each row and head, in position order, at the front.

        The buffers are re-sized to what the kept slots need, so what a layer holds at rest after a
        compaction depends on its budget only, not on how long the prompt was.
        """
        order = self.pos.gather(2, slots).argsort(dim=2, stable=True)
        slots = slots.gather(2, order)
        kept = [held.gather(2, slots[..., None].expand(-1, -1, -1, held.shape[-1])) for held in (self.keys, self.values)]
        kept += [self.pos.gather(2, slots), self.score.gather(2, slots)]
        self.length = slots.shape[2]
        if self.capacity != _grown(self.length):
            self._allocate(self.keys, self.values, _grown(self.length))
        for held, part in zip((self.keys, self.values, self.pos, self.score), kept, strict=True):
            held[:, :, : self.length] = part

    def move_last_into(self, slot: torch.Tensor) -> None:
        """The newest slot takes slot `slot` [batch, kv_heads] in place (the evicted one); one slot fewer."""
        last = self.length - 1
        index = slot[..., None, None]
        for held in (self.keys, self.values):
            held.scatter_(2, index.expand(-1, -1, 1, held.shape[-1]), held[:, :, last : last + 1].clone())
        for held in (self.pos, self.score):
            held.scatter_(2, slot[..., None], held[:, :, last : last + 1].clone())
        self.length = last

    def drop_back(self, count: int) -> None:
        self.length -= count

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.keys is None:
            return
        indices = indices.to(self.keys.device)
        for name in ("keys", "values", "pos", "score"):
            setattr(self, name, getattr(self, name).index_select(0, indices))

    def reset(self) -> None:
        self.keys = self.values = self.pos = self.score = None
        self.length = 0

    def memory(self) -> MemoryReport:
        if self.keys is None:
            return MemoryReport()
        per_slot = (self.keys[:, :, :1].numel() + self.values[:, :, :1].numel()) * self.keys.element_size()
        meta_per_slot = self.pos[:, :, :1].numel() * (self.pos.element_size() + self.score.element_size())
        return MemoryReport(
            payload_bytes=per_slot * self.length,
            reserved_bytes=per_slot * (self.capacity - self.length),
            metadata_bytes=meta_per_slot * self.capacity,
            batch_size=self.batch_size,
        )

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        batch, heads, _, dim = keys.shape
        self.keys = keys.new_empty(batch, heads, capacity, dim)
        self.values = values.new_empty(batch, heads, capacity, values.shape[-1])
        self.pos = torch.full((batch, heads, capacity), PAD, dtype=torch.int64, device=keys.device)
        self.score = torch.zeros(batch, heads, capacity, dtype=torch.float32, device=keys.device)

    def _resize(self, capacity: int) -> None:
        old = self.keys, self.values, self.pos, self.score
        self._allocate(self.keys, self.values, capacity)
        for new, held in zip((self.keys, self.values, self.pos, self.score), old, strict=True):
            new[:, :, : self.length] = held[:, :, : self.length]

    def _check_compatible(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        held = self.keys
        if (keys.shape[0], keys.shape[1], keys.shape[3]) != (held.shape[0], held.shape[1], held.shape[3]) or (
            values.shape[-1] != self.values.shape[-1]
        ):
            raise CacheMismatchError(
                f"new keys/values of shape {tuple(keys.shape)}/{tuple(values.shape)} do not fit the cache's "
                f"[batch={held.shape[0]}, kv_heads={held.shape[1]}, head_dim={held.shape[3]}] layout"
            )
        if keys.dtype != held.dtype or keys.device != held.device:
            raise CacheMismatchError(
                f"new keys are {keys.dtype} on {keys.device}, the cache holds {held.dtype} on {held.device}"
            )
