"""A `SlotStore`'s first-tokens region: exact copies of positions 0 .. first - 1 beside quantized slots, written as
tokens come, put over the decoded slots in dense reads and handed to the decode kernel as its residual."""

from __future__ import annotations

import torch


class SlotExact:
    """The first tokens of each row held exact beside their slots' codes."""

    def _write_exact(self, first_pos: int | torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copies the tokens at positions `first_pos ..` that fall in the first-tokens region into `exact`: by slices
        (nothing once past it) with a Python int, by index with a device count (every step, the positions past the
        region into the spare last entry)."""
        new = keys.shape[2]
        if isinstance(first_pos, int):
            n = min(self.first - first_pos, new)
            if n > 0:
                self.exact["k"][:, :, first_pos : first_pos + n] = keys[:, :, :n]
                self.exact["v"][:, :, first_pos : first_pos + n] = values[:, :, :n]
            return
        at = (first_pos + torch.arange(new, device=keys.device)).clamp(max=self.first).view(1, 1, new)
        rows, heads = self._grid_of(keys.shape[0], keys.shape[1], keys.device)
        self.exact["k"].index_put_((rows, heads, at), keys)
        self.exact["v"].index_put_((rows, heads, at), values)

    def _exact_where(self, pos: torch.Tensor, exact: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """`held` `[batch, kv_heads, k, dim]` (decoded slots whose positions are `pos`) with the first-tokens region's
        exact copies in place of those slots' decoded codes."""
        index = pos.clamp(0, self.first)
        region = exact.gather(2, index[..., None].expand(*index.shape, exact.shape[-1]))
        return torch.where(((pos >= 0) & (pos < self.first))[..., None], region.to(held.dtype), held)

    def exact_mask(self) -> torch.Tensor:
        """The decode kernel's `[batch, slots + first]` mask over the codes then the exact region (`SlotRead.decode_mask`): a
        slot's codes where it holds a real token past the region; region entry i where a slot holds position i. Per
        head, `[batch, kv_heads, slots + first]`, once the heads are not `aligned` (as `valid`).

        Kept between eager decode steps (`EagerMemo`) while no mask has come, no slot is freed and the slots have not moved
        (`version`, the used slots, the buffers): the region's tokens are all held then (never evicted while real), at
        the same slots, and a refill puts a token past the region where one past it was."""
        if self.first_real is None and self.hole is None and not self.device_count and self.seen >= self.first:
            layout = (self.version, self.length, self.aligned)
            return self._exact_mask.get(layout, self._make_exact_mask, anchor=self.fields["pos"])
        return self._make_exact_mask()

    def _make_exact_mask(self) -> torch.Tensor:
        pos = self.positions if not self.aligned else self.positions[:, 0]
        region = torch.arange(self.first, device=pos.device)
        return torch.cat([pos >= self.first, (pos[..., None] == region).any(-2)], dim=-1)

    def exact_part(self) -> tuple[int, int]:
        """Tokens per row held at full precision (every one at full precision, else the exact region's), and bytes per
        element there."""
        if not self.fields:
            return 0, 0
        if self.exact is None:
            full = self.codec.packed(self.fields) is None
            return (min(self.held, self.seen) if full else 0), self.fields["keys"].element_size() if full else 0
        return min(self.first, self.seen, self.held), self.exact["k"].element_size()
