"""A `SlotStore`'s buffers: the per-slot fields, how spans and scattered slots are written and gathered, and the
buffers a compileable store carries from one compiled step to the next at static addresses (`_carried`)."""

from __future__ import annotations

import torch

from ..static_address import mark_static


def _slot_index(slots: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """`slots` [batch, kv_heads, k] broadcast over the trailing dims of a per-slot tensor, for gather."""
    return slots.view(*slots.shape, *([1] * (held.ndim - 3))).expand(*slots.shape, *held.shape[3:])


class SlotBuffers:
    """What the slots are held in and how they are indexed."""

    def used(self) -> dict[str, torch.Tensor]:
        """Every field cut to the used slots: views, made again only when the length or the buffers change
        (every slice is host work in a decode step). A compileable store makes them afresh: kept views would enter
        its compiled graph as inputs aliasing the fields, and a write to aliased inputs copies whole buffers."""
        if self.device_count:
            return {name: held[:, :, : self.length] for name, held in self.fields.items()}
        cut = self._used
        if cut is None or cut[0] != self.length or cut[1] is not self.fields:
            views = {name: held[:, :, : self.length] for name, held in self.fields.items()}
            cut = self._used = (self.length, self.fields, views)
        return cut[2]

    def _span_slots(self, lo: int, hi: int) -> torch.Tensor:
        """Slots `lo .. hi - 1` of every row and head, `[batch, kv_heads, hi - lo]`."""
        return torch.arange(lo, hi, device=self.device).expand(*self.pos.shape[:2], -1)

    def _write_slots(self, slots: torch.Tensor, parts: dict[str, torch.Tensor | float]) -> None:
        """`fields[name][:, :, slots] = parts[name]` for each part, `slots` [batch, kv_heads, k].

        Written by `index_put_` with (row, head, slot) indices: a compiled graph updates the fields in place even
        when a step writes one twice with reads between (a refill or an append, then an eviction); a slice
        assignment, a `scatter_` or an `index_copy_` into a flat view made it copy whole buffers every step, so a
        compileable store (`device_count`) writes every span through here too, its eager steps as its compiled ones.
        Otherwise a scalar (a position, a zeroed score, PAD) goes into a per-slot field by `scatter_` with the value:
        a third of a `new_full` plus `index_put_`.
        """
        index = None
        for name, part in parts.items():
            field = self.fields[name]
            if not isinstance(part, torch.Tensor):
                if not self.device_count and field.ndim == slots.ndim:  # a scalar: one op and no tensor to make
                    field.scatter_(2, slots, part)
                    continue
                part = field.new_full((), part)  # a fill on the device: `torch.tensor` would copy from the host, waiting
            index = index or self._index(slots)
            field.index_put_(index, part)

    def _index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, head, slot) indices of `slots` for `index_put_`."""
        return (*self._grid_of(*slots.shape[:2], slots.device), slots)

    def _grid_of(self, batch: int, heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`[batch, 1, 1]` row and `[1, heads, 1]` head indices; kept between steps, but for a compileable store, whose
        graph makes them (kept ones would be inputs it does not need)."""
        grid = self._grid
        if grid is None or grid[0] != (batch, heads, device) or self.device_count:
            rows = torch.arange(batch, device=device).view(batch, 1, 1)
            grid = ((batch, heads, device), rows, torch.arange(heads, device=device).view(1, heads, 1))
            if not self.device_count:
                self._grid = grid
        return grid[1], grid[2]

    def _gather(self, slots: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        names = self.fields if names is None else names
        return {name: self.fields[name].gather(2, _slot_index(slots, self.fields[name])) for name in names}

    def _allocate(self, like: dict[str, torch.Tensor], capacity: int) -> None:
        self.fields = {
            name: part.new_zeros(*part.shape[:2], capacity, *part.shape[3:]) for name, part in like.items()
        }
        if self.device_count:  # (decode steps write the fields in place, compiled ones too)
            mark_static(*self.fields.values())
            if self.count.tensor is None:
                self.count.place(self.device)
            if self.range_guard is not None and not self.range_guard.in_place:  # (its count, added to in place)
                self.range_guard.place(self.device)
            slot = self.pos.new_zeros(*self.pos.shape[:2], 1)
            for name in ("hole", "fresh"):  # made here, eagerly: a compiled step that made them would return them
                if name not in self._carry or self._carry[name].shape != slot.shape:
                    self._carry[name] = slot.clone()
                    mark_static(self._carry[name])

    def _carried(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value`, which the next step reads as `self.<name>`. A compileable store copies it into a buffer of its own
        (`_carry`) at a static address: what a graph returns lives in its CUDA graph's memory pool, which the next
        replay overwrites, so the state one compiled step leaves for the next must be written into the graph's
        inputs, as the fields are."""
        if not self.device_count:
            return value
        held = self._carry.get(name)
        if held is None or held.shape != value.shape:  # (eagerly, but for a first mask that comes in a compiled step)
            held = self._carry[name] = value.clone()
            mark_static(held)
            return held
        return held.copy_(value)

    def _resize(self, capacity: int) -> None:
        old = self.fields
        self._allocate(old, capacity)
        for name, held in old.items():
            self.fields[name][:, :, : self.length] = held[:, :, : self.length]
