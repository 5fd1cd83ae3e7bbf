"""What eviction policies read and rewrite in a `SlotStore`: scores joined from attention mass, the fresh tokens'
positions, keys and values (scored as they arrive), and keys rewritten in place (sinks re-rotated)."""

from __future__ import annotations

import torch


class SlotAccess:
    """What a policy reads and writes."""

    def add_scores(self, mass: torch.Tensor) -> None:
        """Adds `mass` [batch, kv_heads, length] to the used slots' scores (in place; by index in a compileable
        store, as `_write_slots` says why)."""
        if self.device_count:
            self._write_slots(self._span_slots(0, self.length), {"score": self.scores + mass})
        else:
            self.scores.add_(mass)

    def max_scores(self, mass: torch.Tensor) -> None:
        """Raises the used slots' scores to `mass` [batch, kv_heads, length] where it is larger (in place; by index in
        a compileable store, as `add_scores`)."""
        if self.device_count:
            self._write_slots(self._span_slots(0, self.length), {"score": torch.maximum(self.scores, mass)})
        else:
            torch.maximum(self.scores, mass, out=self.scores)

    def set_scores(self, mass: torch.Tensor) -> None:
        """Sets the used slots' scores to `mass` [batch, kv_heads, length] (by index in a compileable store)."""
        if self.device_count:
            self._write_slots(self._span_slots(0, self.length), {"score": mass})
        else:
            self.scores.copy_(mass)

    def fresh_positions(self) -> torch.Tensor:
        """`[batch, kv_heads, new]` positions of the slots the last append wrote."""
        if isinstance(self.fresh, tuple):
            return self.pos[:, :, self.fresh[0] : self.fresh[1]]
        return self.pos.gather(2, self.fresh)

    def fresh_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values `[batch, kv_heads, new, dim]` of the slots the last append wrote, as attention reads
        them (decoded; the first-tokens region exact): what a policy that scores tokens by their own keys reads."""
        if isinstance(self.fresh, tuple):
            part = {name: held[:, :, self.fresh[0] : self.fresh[1]] for name, held in self.fields.items()}
        else:
            part = self._gather(self.fresh)
        keys, values = self.codec.decode_keys(part, self.dtype), self.codec.decode_values(part, self.dtype)
        if self.exact is None:
            return keys, values
        pos = part["pos"]
        return self._exact_where(pos, self.exact["k"], keys), self._exact_where(pos, self.exact["v"], values)

    def write_fresh_scores(self, scores: torch.Tensor) -> None:
        """Sets the scores of the slots the last append wrote to `scores` [batch, kv_heads, new]."""
        if isinstance(self.fresh, tuple):
            self.fields["score"][:, :, self.fresh[0] : self.fresh[1]] = scores
        else:
            self.fields["score"].scatter_(2, self.fresh, scores)

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """Dense keys of slots `slots` [batch, kv_heads, k]."""
        names = [name for name in self.fields if name in self.codec.key_fields]
        keys = self.codec.decode_keys(self._gather(slots, names), self.dtype)
        return keys if self.exact is None else self._exact_where(self.pos.gather(2, slots), self.exact["k"], keys)

    def write_leading_keys(self, keys: torch.Tensor) -> None:
        """Overwrites the keys of slots 0 .. n - 1 of every row and head with `keys` [batch, kv_heads, n, head_dim]."""
        n = keys.shape[2]
        lead = self._leading(n)
        if self.exact is None or n > self.first:  # (codes of the region's slots are never read: not coded)
            self.codec.write_keys(lead[2], None, keys)
        if self.exact is not None:  # (slots 0 .. n - 1 hold positions 0 .. n - 1 here: `SinkPolicy._shift_unpadded`)
            lead[3].copy_(keys if n <= self.first else keys[:, :, : self.first])

    def leading_exact(self, n: int) -> torch.Tensor | None:
        """The exact keys of slots 0 .. n - 1 `[batch, kv_heads, n, head_dim]` (positions 0 .. n - 1, as
        `write_leading_keys` says), where they alone hold those tokens (a first-tokens region over them): what writing
        into them writes, so a policy can compute the keys straight into it; else None."""
        return self._leading(n)[3] if self.exact is not None and n <= self.first else None

    def _leading(self, n: int) -> tuple:
        """(n, fields, the key fields cut to slots 0 .. n - 1, the exact keys of those in the region or None), cut once
        per buffers: the same slots every step."""
        lead = self._lead
        if lead is None or lead[0] != n or lead[1] is not self.fields:
            cut = {name: self.fields[name][:, :, :n] for name in self.codec.key_fields if name in self.fields}
            exact = None if self.exact is None else self.exact["k"][:, :, : min(n, self.first)]
            lead = self._lead = (n, self.fields, cut, exact)
        return lead

    def write_keys(self, slots: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Overwrites the keys of slots `slots` [batch, kv_heads, k] with `keys` [batch, kv_heads, k, head_dim],
        in the batch rows where `rows` [batch] (bool) is True, or of the slots where `rows` [batch, k] is (None: all);
        the others keep their bits."""
        parts = self.codec.encode_keys(keys)
        if rows is not None:
            rows = rows[:, None, None] if rows.ndim == 1 else rows[:, None, :]  # [batch, 1, 1 or k]
            kept = self._gather(slots, parts)
            parts = {name: torch.where(rows.view(*rows.shape, *[1] * (p.ndim - 3)), p, kept[name])
                     for name, p in parts.items()}  # fmt: skip
        self._write_slots(slots, parts)
        if self.exact is not None:  # the region's slots in the written rows, the others into the spare last entry
            pos = self.pos.gather(2, slots)
            inside = (pos >= 0) & (pos < self.first)
            at = torch.where(inside if rows is None else inside & rows, pos, self.first)
            grid = self._grid_of(*slots.shape[:2], slots.device)
            self.exact["k"].index_put_((*grid, at), keys.to(self.exact["k"].dtype))
