"""Padding in slots: which slots a model's mask hides (`hidden_slots`, by the position each holds), marked PAD, and
each row's first real position, learned on the device."""

from __future__ import annotations

import torch

from ..errors import ShapeError

#: `pos` of a slot holding a padding token.
PAD = -1


def hidden_slots(attention_mask: torch.Tensor, positions: torch.Tensor, seen: int | torch.Tensor) -> torch.Tensor:
    """`[batch, kv_heads, slots]` True where the model's 4-d mask hides the token a slot holds at `positions`.

    Each call's mask covers every position a slot may hold (`KVLayer.get_mask_sizes`): its last column is the newest
    token, `seen - 1`, so column c is position `seen - width + c` (a mask of fixed width, a compileable store's, is
    wider than the tokens seen while the slots fill: column c is position c then). Its last query is the newest token,
    which sees every past key the model lets it see, so the keys it may not see are masked: padding, or any 0 of the
    2-d mask over a held position. Slots map by the position they hold, not by their index (after evictions the two
    differ, per head); a slot holding no token (PAD) or a position left of the mask is not hidden. All on the device.
    """
    if attention_mask.ndim != 4:
        raise ShapeError(f"expected a 4-d attention mask, got shape {tuple(attention_mask.shape)}")
    last = attention_mask[:, 0, -1]
    allowed = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    width = allowed.shape[-1]
    offset = (seen - width).clamp(min=0) if isinstance(seen, torch.Tensor) else max(0, seen - width)
    column = positions - offset
    batch = positions.shape[0]
    seen_by_last = allowed.expand(batch, -1).gather(1, column.clamp(0, width - 1).flatten(1)).view_as(column)
    return (column >= 0) & ~seen_by_last


class SlotMasks:
    """What the model's masks hide, marked in the slots."""

    def valid(self) -> torch.Tensor | None:
        """True where a slot holds a real token: `[batch, slots]` while the heads are `aligned`, else `[batch,
        kv_heads, slots]` (a masked token sits at its own slot in each head that holds it); None while no mask ever
        came (all do)."""
        if self.first_real is None:
            return None
        pos = self.positions
        return pos[:, 0] != PAD if self.aligned else pos != PAD

    def note_mask(self, attention_mask: torch.Tensor, new: int) -> None:
        """Marks every used slot whose token the model's mask hides as padding (`hidden_slots`: left padding, and any 0
        of the 2-d mask over a token held from an earlier forward), and learns each row's first real position from the
        fresh tokens (on the device). A slot once marked stays padding, as Transformers' 2-d mask in `generate` keeps
        its zeros; it is evicted first.

        A compileable store's compiled one-token steps mark their fresh slot only (a graph that rewrote every slot's
        position would copy the field each step): a 0 that such a step adds over an older held token is not seen, as
        its fixed-width mask may not reach it either. Generate's decode steps add none (the zeros of a later turn come
        with its prompt, which marks every slot).

        A mask that hides nothing (a prompt's later chunk, a later turn's prompt: causality alone) leaves the store as
        it was, every row real from position 0, so that its policies keep their Python-int paths (StreamingLLM's
        known victim and sink shift: a decode step at 4K on two cores took 1.3x as long through the padded rules).
        Knowing that costs one device-to-host sync per layer, in such forwards only, until a mask first hides a token:
        where no row is padded, Transformers passes decode steps no mask. Not for a compileable store, whose steps
        must not sync, and which keeps its device-side rules throughout."""
        seen = self.seen_now()
        compiling = torch.compiler.is_compiling()
        fresh_only = self.device_count and new == 1 and compiling
        if fresh_only:
            slots = self.fresh if isinstance(self.fresh, torch.Tensor) else self._span_slots(*self.fresh)
            pos = self.pos.gather(2, slots)
        else:
            pos = self.used()["pos"]
        hidden = hidden_slots(attention_mask, pos, seen)
        if self.first_real is None and not self.device_count and not compiling and not hidden.any():
            return  # (one sync per layer, see above) nothing hidden: every row is still real from position 0
        if self.count_hidden:  # the positions of the real tokens hidden now (-1 elsewhere), before they are marked
            lost = pos[:, 0].masked_fill(~hidden[:, 0], PAD)
        if fresh_only:
            self._write_slots(slots, {"pos": pos.masked_fill(hidden, PAD)})
        else:
            self.mark_hidden(hidden)
        first_real = self.first_real
        if first_real is None:
            # Tokens before the first mask were real: those rows start at 0; the others are learned now.
            if isinstance(seen, torch.Tensor):  # a compiled step: 0 where tokens came before, else -1, on the device
                first_real = ((seen > new).long() - 1).expand(self.batch_size)
            else:
                start = 0 if seen > new else -1
                first_real = torch.full((self.batch_size,), start, dtype=torch.int64, device=self.device)
        pos = self.fresh_positions()[:, 0]
        real = pos != PAD
        first = torch.where(real.any(-1), pos.masked_fill(~real, seen).min(-1).values, -1)
        self.first_real = self._carried("first_real", torch.where(first_real >= 0, first_real, first))
        if self.count_hidden:  # (those before the first real token are its padding)
            first = self.first_real[:, None]
            counted = ((lost >= first) & (lost >= 0) & (first >= 0)).sum(-1)
            self.hidden = self._carried("hidden", counted if self.hidden is None else self.hidden + counted)

    def note_no_mask(self) -> None:
        """Every row starts at position 0, where no mask came before: `first_real` made now (eagerly, at the prompt)
        rather than in the first masked step, which may be compiled, and a graph that made it would return it."""
        if self.first_real is None:
            self.first_real = self._carried("first_real", self.pos.new_zeros(self.batch_size))
            if self.count_hidden:
                self.hidden = self._carried("hidden", self.pos.new_zeros(self.batch_size))

    def mark_hidden(self, hidden: torch.Tensor) -> None:
        """Marks the used slots where `hidden` [batch, kv_heads, length] is True as padding (`pos` PAD): attention
        masks them from now on and every policy evicts them first."""
        if self.device_count:  # by index, as `_write_slots` says why
            pos = self.used()["pos"]
            self._write_slots(self._span_slots(0, self.length), {"pos": pos.masked_fill(hidden, PAD)})
        else:
            self.used()["pos"].masked_fill_(hidden, PAD)
