"""Slot storage for scored retentions: every (batch row, KV head) keeps its own set of tokens.

Evicting caches keep different tokens per KV head (H2O, SnapKV), so tokens live in slots: slot j of
row b, head h holds one token's key and value, its logical position (`pos`, -1 for a padding slot)
and, for a policy that ranks by it, its accumulated attention mass (`score`; StreamingLLM ranks by position and
keeps none). Attention reads the slots with a mask built from `pos`,
so slot order does not matter to it; compaction keeps slots in position order anyway (padding
first). A token the model's mask hides (left padding, or a 0 of a later forward's 2-d mask over a held token) is marked
PAD in every head that holds it, by its position (`hidden_slots`); while every head holds the same positions at the same
slots (`aligned`) that is one mask per row, else one per head.

How a token's key and value are held is the codec's business: full precision, or quantized per
token (a token's key and value each stand alone, so any slot can be overwritten in place).

A first-tokens region (`first`: the tokens at positions 0 .. first - 1 of each row, attention sinks) stays exact in
quantized slots: the store keeps their keys and values at full precision in a small side buffer indexed by position
(`exact`), reads hand it to the decode kernel as the residual after the codes (`SlotRead.residual_k`), with those slots' codes
masked out, and dense reads put it over the decoded slots. Policies never evict a real token of the region (it ranks
with the recent window), so it is at the same slots in every head.

Quantized slots code a token as it comes, so what the codes cannot hold (`value_range`: NaN, inf, finite values past
their float16 scales, zero points or norms) is caught there: a prompt is refused before it is stored (`check_prompt`),
and a decode step's token goes through the store's `RangeGuard`, which codes such values (a rotated format's vectors)
as 0 (its exact copy too, in a first-tokens region) and counts them on the device, so its slot decodes finite and the
next prompt or `quantized_report()` raises `OutOfRangeError` for them. Codes are per token, so no other token's codes
depend on it; nor does a rotated format's key centre, which a one-token first forward would otherwise set.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..static_address import mark_static
from .base import KVStorage, check_fits
from .dense import _grown
from .eager_memo import EagerMemo
from .reads import SlotRead, placeholders
from .slot_access import SlotAccess
from .slot_buffers import SlotBuffers, _slot_index
from .slot_codecs import DenseCodec, TokenQuantCodec
from .slot_exact import SlotExact
from .slot_holes import SlotHoles
from .slot_masks import PAD, SlotMasks, hidden_slots
from .slot_reports import SlotReports
from .token_count import TokenCount, counted
from .value_range import RangeGuard, code_limit

__all__ = ["PAD", "DenseCodec", "SlotStore", "TokenQuantCodec", "hidden_slots"]


class SlotStore(SlotAccess, SlotHoles, SlotMasks, SlotExact, SlotReports, SlotBuffers, KVStorage):
    """Per-slot tensors `[batch, kv_heads, capacity, ...]` (the codec's fields, `pos`, and with `scores` the
    `score` a policy ranks by); `length` used.

    A `KVStorage` whose tokens are not in sequence order: a scored retention (`eviction`) picks the
    slots to keep. A decode step evicts one slot per row and head without moving any: `free(slot)`
    leaves it in place as the `hole`, and the next one-token `append` writes the new token over it.
    The hole is a Python int when the policy knows the slot without looking at the device
    (StreamingLLM's oldest window token in a known layout), else a `[batch, kv_heads, 1]` tensor (H2O's
    lowest score) that the append scatters into. Any other operation first `settle`s the hole (the
    last slot moves into it).

    Until a mask from the model hides a token, every slot holds a real token and each row's first real position
    is 0 (`first_real` is None, policies work in Python ints). Once one did (left padding, maybe),
    slots whose token it hides get `pos` PAD (padding, or held tokens a later mask hides: `note_mask`) and
    `first_real` [batch] is kept on the device, updated with each forward's tokens, never read back.

    `first` keeps the first tokens of each row exact (see the module's docstring): `exact_part` counts them.

    With `device_count` (a compileable cache's store) `seen` is counted on the device too (`TokenCount`) and the
    fields are at static addresses, so that a compiled step reads and writes no Python int: its new tokens' positions
    come from the device count, and it holds `budget + 1` slots from the prompt on, the unused ones free (`fill_free`).
    """

    reads_in_place = True

    def __init__(
        self,
        codec: DenseCodec | TokenQuantCodec | None = None,
        scores: bool = True,
        device_count: bool = False,
        first: int = 0,
        count_hidden: bool = False,
    ):
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"the first-tokens region must be an int >= 0 tokens, got first={first!r}")
        self.codec = codec or DenseCodec()
        #: Positions 0 .. first - 1 of each row: never evicted while real (policies rank them with the recent window),
        #: and held exact in `exact` too where the codec codes.
        self.first = first
        # Their keys and values, `[batch, kv_heads, first + 1, dim]` by position (the last entry takes the writes of
        # positions past the region in a compileable store's steps, which write by index whatever the position).
        self.exact: dict[str, torch.Tensor] | None = None
        self.keeps_scores = scores
        self.device_count = device_count
        self.fields: dict[str, torch.Tensor] = {}
        self.length = 0
        self.count = TokenCount()  # `seen`
        self.dtype: torch.dtype | None = None
        # A freed slot, still counted in `length` until refilled or settled: the same in every row and head
        # (a Python int) or a [batch, kv_heads, 1] tensor.
        self.hole: int | torch.Tensor | None = None
        # The slots the last append wrote: `(lo, hi)`, or a [batch, kv_heads, 1] tensor after a tensor hole's refill.
        self.fresh: tuple[int, int] | torch.Tensor = (0, 0)
        self.in_order = True  # slots hold increasing positions (appends at the end since the last compaction)
        #: Every head of a row holds the same positions at the same slots (appends, and evictions that rank every head
        #: alike: `uniform`), so a row's padding is at the same slots in every head and `valid()` is one [batch, slots]
        #: mask; False once a policy ranked the heads apart (H2O, SnapKV, ...): then it is per head.
        self.aligned = True
        self.version = 0  # bumped whenever slots move, so a policy tracking the layout knows to stop
        self.first_real: torch.Tensor | None = None  # [batch] first real position per row (-1: none yet), once masked
        #: With `count_hidden` (StreamingLLM's sinks close up on the evicted tokens, not on masked ones): [batch] how many
        #: tokens past each row's first real one a mask has hidden, held or evicted since; kept with `first_real`.
        self.count_hidden = count_hidden
        self.hidden: torch.Tensor | None = None
        self._used: tuple | None = None  # (length, fields, their views cut to the used slots)
        self._read: tuple | None = None  # (the views of `_used`, the read made of them)
        self._grid: tuple | None = None  # ((batch, heads, device), row and head indices for `_write_slots`)
        self._fits = EagerMemo()  # `check_fits` passed for the fields' `pos` and new tokens of these shapes
        self._lead: tuple | None = None  # (n, fields, slots 0 .. n - 1's key fields, exact keys): `SlotAccess._leading`
        self._exact_mask = EagerMemo()  # `exact_mask`'s mask, for a layout of the slots
        self._carry: dict[str, torch.Tensor] = {}  # a compileable store's buffers for `hole`, `fresh`, `first_real`
        fmt = getattr(self.codec, "fmt", None)
        #: What a decode step's token holds that the codes cannot: coded as 0, counted on the device (`value_range`).
        self.range_guard = None if fmt is None else RangeGuard(*code_limit(fmt))

    seen = counted("Tokens appended (the next token's logical position), less those dropped from the back.")

    def __getstate__(self) -> dict:
        """The memos of views travel empty (made again on use): a stale one holds the buffers it cut, e.g. a prompt's
        from before eviction, which a pickle or a saved cache would otherwise carry."""
        return {**self.__dict__, "_used": None, "_read": None, "_lead": None}

    def seen_now(self) -> int | torch.Tensor:
        """`seen` as a step computes with it: a compileable store's device count (once placed: a compiled step reads
        no Python int, and its eager steps take the same path), else the int."""
        if self.device_count and self.count.tensor is not None:
            return self.count.tensor
        return self.seen

    @property
    def pos(self) -> torch.Tensor:
        return self.fields["pos"]

    @property
    def score(self) -> torch.Tensor:
        return self.fields["score"]

    @property
    def _zeroed(self) -> dict[str, float]:
        """The score of a freshly written slot, when slots keep scores."""
        return {"score": 0.0} if self.keeps_scores else {}

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0] if self.fields else 0

    @property
    def capacity(self) -> int:
        return self.pos.shape[2] if self.fields else 0

    @property
    def held(self) -> int:
        """Tokens held: the slots in use less a freed one."""
        return self.length - (self.hole is not None)

    @property
    def positions(self) -> torch.Tensor:
        """`[batch, kv_heads, length]` positions of the used slots, PAD for padding and for a freed slot that is not
        refilled yet (a copy then: a freed slot keeps its token's position until refilled, unless masked)."""
        pos, hole = self.used()["pos"], self.hole
        if hole is None or (self.first_real is not None and isinstance(hole, torch.Tensor)):
            return pos
        if isinstance(hole, int):
            return torch.cat([pos[:, :, :hole], pos.new_full((*pos.shape[:2], 1), PAD), pos[:, :, hole + 1 :]], dim=2)
        return pos.scatter(2, hole, PAD)

    @property
    def scores(self) -> torch.Tensor:
        return self.used()["score"]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes `new` tokens at the next logical positions into slots `length ..` (or the hole)."""
        new = keys.shape[2]
        first_pos = self.seen_now()
        if isinstance(first_pos, torch.Tensor):  # a copy: the count changes in place below
            first_pos = first_pos.clone()
        self.count.advance(new)
        if self.fields:
            self._check_compatible(keys, values)
        guard = None
        if new == 1 and self.range_guard is not None:  # (a prompt was checked whole: `KVLayer.update`)
            past_region = self.exact is None or (isinstance(first_pos, int) and first_pos >= self.first)
            if self.fields and past_region and not self.device_count and self.codec.guards(keys):
                guard = self.range_guard  # folded into the coding: one operator call per side, no guarded copies
            else:
                keys, values = self._guarded(keys, values)
        if self.hole is not None:
            if new == 1:  # the freed slot takes the token
                self._refill(keys, values, first_pos, guard)
                return
            self.settle()
        if not self.fields:
            self.dtype, self.device = keys.dtype, keys.device
            self._like = keys.new_empty(0)  # what a read's placeholders are made like
            self.head_dims = (keys.shape[1], keys.shape[3], values.shape[3])
            slot_fields = {"pos": keys.new_empty(keys.shape[:3], dtype=torch.int64)}
            if self.keeps_scores:
                slot_fields["score"] = keys.new_empty(keys.shape[:3], dtype=torch.float32)
            # Shaped from every new token's codes, not the first one's: a layer's state (a rotated format's key
            # centre) is set by the first keys coded, and the first token alone is often the attention sink.
            self._allocate({**self.codec.encode(keys, values), **slot_fields}, _grown(new))
            if self.first and self.codec.packed(self.fields) is not None:  # full precision is exact already
                batch, heads = keys.shape[:2]
                self.exact = {name: x.new_zeros(batch, heads, self.first + 1, x.shape[3])
                              for name, x in (("k", keys), ("v", values))}  # fmt: skip
                if self.device_count:
                    mark_static(*self.exact.values())
        elif self.length + new > self.capacity:
            self._resize(_grown(self.length + new))
        self._write(self.length, keys, values, first_pos, guard)
        self.length += new

    def _guarded(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's key and value as they are coded: what the format cannot hold as 0, counted on the device (no
        read back; `RangeGuard`). One guard call over both when they have the same shape (a decode step's ops are its
        host cost), stacked by rows so that each comes back contiguous."""
        guard = self.range_guard
        if keys.shape != values.shape:
            return guard(keys), guard(values)
        keys, values = guard(torch.cat([keys, values])).split(keys.shape[0])
        return keys, values

    def _write(self, lo: int, keys: torch.Tensor, values: torch.Tensor, first_pos: int, guard=None) -> None:
        """Writes the tokens of `keys`/`values` at logical positions `first_pos ..` into slots `lo ..`, scores
        zeroed; through `guard`, a `RangeGuard` the codec folds into its coding (`append`)."""
        new = keys.shape[2]
        self.fresh = (lo, lo + new)
        if self.exact is not None:
            self._write_exact(first_pos, keys, values)
        if self.device_count:  # by index, as `_write_slots` says why (its positions come from the device count)
            slots = self._span_slots(lo, lo + new)
            self._write_slots(slots, {**self.codec.encode(keys, values), "pos": slots + (first_pos - lo), **self._zeroed})
            return
        span = slice(lo, lo + new)
        self.codec.write(self.fields, span, keys, values, guard)
        if new == 1:  # a decode step: fill in place, no index tensor (a select: cheaper than a slice)
            self.fields["pos"].select(2, lo).fill_(first_pos)
        else:
            self.fields["pos"][:, :, span] = torch.arange(first_pos, first_pos + new, device=self.device)
        if self.keeps_scores:
            self.fields["score"].narrow(2, lo, new).zero_()

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values of the used slots (views for full precision, dequantized otherwise)."""
        used = self.used()
        keys, values = self.codec.decode_keys(used, self.dtype), self.codec.decode_values(used, self.dtype)
        if self.exact is None:
            return keys, values
        pos = used["pos"]
        return self._exact_where(pos, self.exact["k"], keys), self._exact_where(pos, self.exact["v"], values)

    def read(self, last: int, new: int) -> SlotRead:
        """Every used slot (slots are not in sequence order: attention masks them by what they hold); quantized
        slots as their codes, which the decode kernel reads in place (no dequantized copy unless asked for).
        Kept while the used slots' views are (a decode step at the budget reads the same slots as the last)."""
        used = self.used()
        kept = self._read
        if kept is not None and kept[0] is used:  # (a compileable store's views are new each step: never kept)
            return kept[1]
        packed = self.codec.packed(used)
        if packed is None:
            read = SlotRead(*self.slots(), self.valid)
        else:
            keys, values = placeholders(self._like, *packed.k.shape[:3], *self.head_dims[1:])
            read = SlotRead(keys, values, self.valid, packed, self.codec.fmt, self.slots, state=self.codec.state)
            if self.exact is not None:
                exact_k, exact_v = (self.exact[name][:, :, : self.first] for name in ("k", "v"))
                read = read._replace(residual_k=exact_k, residual_v=exact_v, decode_mask=self.exact_mask)
        if not self.device_count:  # (a compileable store's read is made afresh, as its views: `used`)
            self._read = (used, read)
        return read

    def view(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values of the held tokens (`last` is all of them: slots have no sequence order)."""
        return self.held_view()

    def held_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values of the held tokens: `slots` less the hole (a copy then; slots stay put)."""
        keys, values = self.slots()
        if self.hole is None:
            return keys, values
        live = torch.arange(self.length - 1, device=keys.device)
        slots = (live + (live >= self.hole)).expand(*keys.shape[:2], -1)
        return keys.gather(2, _slot_index(slots, keys)), values.gather(2, _slot_index(slots, values))

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.fields:
            indices = indices.to(self.device)
            self.fields = {name: held.index_select(0, indices) for name, held in self.fields.items()}
            if self.exact is not None:
                self.exact = {name: held.index_select(0, indices) for name, held in self.exact.items()}
            if self.device_count:
                mark_static(*self.fields.values(), *(self.exact or {}).values())
        carried = {name: getattr(self, name) is held for name, held in self._carry.items()}
        self._carry = {name: held.index_select(0, indices.to(held.device)) for name, held in self._carry.items()}
        mark_static(*self._carry.values())
        for name in ("hole", "fresh", "first_real", "hidden"):
            value = getattr(self, name)
            if carried.get(name):
                setattr(self, name, self._carry[name])
            elif isinstance(value, torch.Tensor):
                setattr(self, name, value.index_select(0, indices.to(value.device)))

    def reset(self) -> None:
        if self.range_guard is not None:
            self.range_guard.take()  # (what it counted goes with the tokens)
        self.fields = {}
        self.exact = None
        self._used = self._read = self._lead = None  # (views of the old buffers would keep them)
        self.length = self.seen = 0
        self.first_real = self.hidden = None
        self.hole = None
        self.fresh = (0, 0)
        self._carry = {}
        self.in_order = True
        self.aligned = True
        self.version += 1

    def _check_compatible(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`check_fits`, once per buffers and new tokens' shapes (`EagerMemo`; new fields have a new `pos`)."""
        self._fits.get((keys.shape, values.shape, keys.dtype, keys.device), self._check_fits, keys, values,
                       anchor=self.fields["pos"])  # fmt: skip

    def _check_fits(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        check_fits(keys, values, (self.batch_size, *self.head_dims), self.dtype, self.device)
