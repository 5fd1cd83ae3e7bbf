"""A `SlotStore`'s hole bookkeeping and compaction: a decode step's victim freed in place (`free`) and refilled by
the next one-token append, the free slots of a compileable store (`fill_free`), and compaction (`keep`, `settle`)."""

from __future__ import annotations

import torch

from .dense import _grown
from .slot_masks import PAD


class SlotHoles:
    """Evicting without moving: the hole, free slots and compaction."""

    def _refill(self, keys: torch.Tensor, values: torch.Tensor, first_pos: int, guard=None) -> None:
        """The hole takes the one token of this append (through `guard`, as `_write` says)."""
        hole, self.hole = self.hole, None
        self.in_order = False
        if isinstance(hole, int):
            self._write(hole, keys, values, first_pos, guard)
            return
        self.fresh = self._carried("fresh", hole)
        if self.exact is not None:
            self._write_exact(first_pos, keys, values)
        if self.device_count:
            self._write_slots(hole, {**self.codec.encode(keys, values), "pos": first_pos, **self._zeroed})
            return
        self.codec.write_at(self.fields, hole, keys, values, guard)
        self.fields["pos"].scatter_(2, hole, first_pos)  # scalars by `scatter_`, as `_write_slots` says why
        if self.keeps_scores:
            self.fields["score"].scatter_(2, hole, 0.0)

    def free(self, slot: int | torch.Tensor, uniform: bool = False) -> None:
        """Evicts the token in `slot` by bookkeeping only: a Python int (the same slot in every row and
        head) or a `[batch, kv_heads, 1]` tensor of slots. The slot stays counted in `length` as the hole.

        Once a mask came, the hole reads as padding until refilled (the sinks' `after_evict` counts real
        tokens by position); before, nothing reads positions before the refill, so it keeps its token's
        (`positions` shows PAD there). `uniform`: a tensor `slot` is the same in every head of a row (ranked by
        position), which keeps the heads aligned."""
        if isinstance(slot, int):
            self.hole = slot
            return
        self.aligned = self.aligned and uniform
        self.hole = self._carried("hole", slot)
        if self.first_real is not None:
            self._write_slots(self.hole, {"pos": PAD})
        # No layout a policy could follow in Python ints. (A compileable store's steps write no Python int, which a
        # compiled graph would take as an input: no policy follows its layout, as `SinkPolicy.victim` says.)
        if not self.device_count:
            self.version += 1

    def fill_free(self, slots: int) -> None:
        """Makes `slots` slots used, those after the held tokens free (padding: `pos` PAD, which attention masks and
        every policy ranks lowest) and the first of them the hole (a tensor). The next one-token append refills it,
        and each step's eviction then frees another free slot while there is one, then a token: a compileable
        store's decode steps have the same shapes and ops from the first one, full or not (eagerly, at the prompt)."""
        if slots > self.capacity:
            self._resize(_grown(slots))
        free = torch.arange(self.length, slots, device=self.device).expand(*self.pos.shape[:2], -1)
        self._write_slots(free, {"pos": PAD})
        self.length = slots
        self.free(free[..., :1].contiguous(), uniform=True)

    @property
    def mask_width(self) -> int | None:
        """A compileable store's width of the model's mask: its slots, free ones included (`fill_free`), so that the
        mask keeps one shape while the slots fill; None before its first append, and for other stores."""
        return self.length if self.device_count and self.length else None

    def settle(self) -> None:
        """Closes the hole: the last slot moves into it."""
        if self.hole is None:
            return
        slot, last = self.hole, self.length - 1
        if isinstance(slot, int):
            if slot != last:
                for held in self.fields.values():
                    held[:, :, slot] = held[:, :, last]
        else:  # torch refuses a source that aliases the target: the last slot is copied first
            lasts = {name: held[:, :, last : last + 1].clone() for name, held in self.fields.items()}
            self._write_slots(slot, lasts)
        self.hole = None
        self.length = last
        self.in_order = False
        self.version += 1

    def keep(self, slots: torch.Tensor, reallocate: bool = False, uniform: bool = False) -> None:
        """Keeps slots `slots` [batch, kv_heads, kept] of each row and head, in position order, at the front.
        `uniform`: the slots were ranked alike in every head of a row (by position), which keeps the heads aligned.

        The buffers are re-sized to what the kept slots need (new ones with `reallocate`), so what a layer
        holds at rest after a compaction depends on its budget only, not on how long the prompt was.
        """
        self.settle()
        self.aligned = self.aligned and uniform
        slots = slots.gather(2, self.pos.gather(2, slots).argsort(dim=2, stable=True))
        kept = self._gather(slots)
        self.length = slots.shape[2]
        if reallocate or self.capacity != _grown(self.length):
            self._allocate(kept, _grown(self.length))
        for name, part in kept.items():
            self.fields[name][:, :, : self.length] = part
        self.in_order = True
        self.version += 1

    def drop_front(self, count: int) -> None:
        """Forgets the `count` tokens of lowest position (padding first), into new buffers: an ordered retention
        drops right after `update`, and the read it returned still names the old slots."""
        self.settle()
        order = self.positions.argsort(dim=-1, descending=True, stable=True)
        self.keep(order[..., : self.held - count], reallocate=True, uniform=True)

    def drop_back(self, count: int) -> None:
        """Forgets the `count` newest tokens: those of the last append, which still sit in the last slots."""
        self.settle()
        self.length -= count
        self.seen -= count
        self.version += 1
