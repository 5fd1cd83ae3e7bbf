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

from ..errors import ConfigError, ShapeError
from ..kernels.dispatch import quantize_values, quantize_values_at
from ..kernels.quant_format import PACKED_NAMES, PackedKV, QuantFormat, dequantize_values
from ..memory import MemoryReport
from ..static_address import mark_static
from .base import KVStorage, check_fits
from .dense import _grown
from .eager_memo import EagerMemo
from .reads import SlotRead, placeholders
from .token_count import TokenCount, counted
from .value_range import RangeGuard, code_limit

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


def _slot_index(slots: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """`slots` [batch, kv_heads, k] broadcast over the trailing dims of a per-slot tensor, for gather."""
    return slots.view(*slots.shape, *([1] * (held.ndim - 3))).expand(*slots.shape, *held.shape[3:])


class DenseCodec:
    """Keys and values as they come."""

    payload = ("keys", "values")
    key_fields = ("keys",)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys}

    def decode_keys(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return fields["keys"]

    def decode_values(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return fields["values"]

    def write(self, fields: dict[str, torch.Tensor], span: slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values into slots `span` of `fields`."""
        fields["keys"][:, :, span] = keys
        fields["values"][:, :, span] = values

    def write_keys(self, fields: dict[str, torch.Tensor], span: slice | None, keys: torch.Tensor) -> None:
        """Keys into slots `span` of `fields` (None: `fields` are cut to those slots already)."""
        (fields["keys"] if span is None else fields["keys"][:, :, span]).copy_(keys)

    def write_at(self, fields: dict[str, torch.Tensor], slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values into slots `slots` [batch, kv_heads, 1] (eagerly: by `scatter_`, one index for both)."""
        index = slots[..., None].expand(*keys.shape)
        fields["keys"].scatter_(2, index, keys)
        fields["values"].scatter_(2, index if values.shape == keys.shape else slots[..., None].expand(*values.shape), values)

    def packed(self, fields: dict[str, torch.Tensor]) -> None:
        """Full precision has no codes for a kernel to read."""
        return None

    def __repr__(self) -> str:
        return "DenseCodec()"


class TokenQuantCodec:
    """Keys and values quantized per token over groups of channels (int8/int4/int2 or fp8).

    Per-token keys (not KIVI's per-channel groups) because an evicting layer overwrites single
    slots: a group spanning tokens would have to be re-quantized whenever one of them is evicted. A rotated
    format is per token on both sides already; its keys are coded with the key bits (`fmt.side_formats()`).
    """

    def __init__(self, fmt: QuantFormat):
        self.fmt = fmt
        self._formats = dict(zip(("k", "v"), fmt.side_formats(), strict=True))
        self.payload = ("k", "v")
        self.key_fields = ("k", "k_scale", "k_zero")
        self._fields = {name: (name, f"{name}_scale", f"{name}_zero") for name in self.payload}  # per quantize call

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Both quantized by one call when they have the same shape and format, keys without a centre (tokens
        stand alone, so the codes are those of two calls; a decode step's ops are its host cost), then split."""
        k_fmt, v_fmt = self._formats["k"], self._formats["v"]
        if keys.shape != values.shape or k_fmt != v_fmt or getattr(k_fmt, "value_center", None) is not None:
            return {**self._encode("k", keys), **self._encode("v", values)}
        n = keys.shape[2]
        both = self._encode("kv", torch.cat([keys, values], dim=2))  # fields kv, kv_scale, kv_zero: [.., 2n, ..]
        return {
            name + field[2:]: part[:, :, :n] if name == "k" else part[:, :, n:]
            for name in ("k", "v")
            for field, part in both.items()
        }

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._encode("k", keys)

    def _encode(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale, zero = quantize_values(x.contiguous(), self._formats.get(name, self.fmt), check=False)
        fields = {name: codes, f"{name}_scale": scale}
        if zero is not None:
            fields[f"{name}_zero"] = zero
        return fields

    def _decode(self, fields, name, dtype):
        zero = fields.get(f"{name}_zero")
        return dequantize_values(fields[name], fields[f"{name}_scale"], zero, self._formats[name], dtype=dtype)

    def decode_keys(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self._decode(fields, "k", dtype)

    def decode_values(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self._decode(fields, "v", dtype)

    def write(self, fields: dict[str, torch.Tensor], span: slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values quantized straight into slots `span` of `fields`: the quantize kernel writes the slots'
        codes, scales and zeros, so nothing is copied after it (a decode step's ops are its host cost)."""
        self._quantize_into(fields, span, "k", keys)
        self._quantize_into(fields, span, "v", values)

    def write_keys(self, fields: dict[str, torch.Tensor], span: slice | None, keys: torch.Tensor) -> None:
        """Keys quantized into slots `span` of `fields` (None: `fields` are cut to those slots already)."""
        self._quantize_into(fields, span, "k", keys)

    def write_at(self, fields: dict[str, torch.Tensor], slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values quantized straight into slots `slots` [batch, kv_heads, 1]: one kernel each writes the
        codes, scales and zeros at the slot (a decode step's ops are its host cost)."""
        for name, x in (("k", keys), ("v", values)):
            out = tuple(fields.get(field) for field in self._fields[name])
            quantize_values_at(x.contiguous(), self._formats[name], out, slots, check=False)

    def _quantize_into(self, fields, span, name, x) -> None:
        codes, scale, zero = self._fields[name]
        codes, scale, zero = fields[codes], fields[scale], fields.get(zero)
        if span is not None:
            codes, scale, zero = codes[:, :, span], scale[:, :, span], None if zero is None else zero[:, :, span]
        quantize_values(x.contiguous(), self._formats[name], out=(codes, scale, zero), check=False)

    def packed(self, fields: dict[str, torch.Tensor]) -> PackedKV:
        """The codes as the quantized decode kernel reads them (keys per token)."""
        return PackedKV(*(fields.get(name) for name in PACKED_NAMES))

    def __repr__(self) -> str:
        return f"TokenQuantCodec({self.fmt})"


class SlotStore(KVStorage):
    """Per-slot tensors `[batch, kv_heads, capacity, ...]` (the codec's fields, `pos`, and with `scores` the
    `score` a policy ranks by); `length` used.

    A `KVStorage` whose tokens are not in sequence order: a scored retention (`eviction`) picks the
    slots to keep. A decode step evicts one slot per row and head without moving any: `free(slot)`
    leaves it in place as the `hole`, and the next one-token `append` writes the new token over it.
    The hole is a Python int when the policy knows the slot without looking at the device
    (StreamingLLM's oldest window token in a known layout), else a `[batch, kv_heads, 1]` tensor (H2O's
    lowest score) that the append scatters into. Any other operation first `settle`s the hole (the
    last slot moves into it).

    Until the model passes a mask, every slot holds a real token and each row's first real position
    is 0 (`first_real` is None, policies work in Python ints). Once a mask came (left padding, maybe),
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
        self._lead: tuple | None = None  # (n, fields, the key fields cut to slots 0 .. n - 1) for `write_leading_keys`
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

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes `new` tokens at the next logical positions into slots `length ..` (or the hole)."""
        new = keys.shape[2]
        first_pos = self.seen_now()
        if isinstance(first_pos, torch.Tensor):  # a copy: the count changes in place below
            first_pos = first_pos.clone()
        self.count.advance(new)
        if self.fields:
            self._check_compatible(keys, values)
        if new == 1 and self.range_guard is not None:  # (a prompt was checked whole: `KVLayer.update`)
            keys, values = self._guarded(keys, values)
        if self.hole is not None:
            if new == 1:  # the freed slot takes the token
                self._refill(keys, values, first_pos)
                return
            self.settle()
        if not self.fields:
            self.dtype, self.device = keys.dtype, keys.device
            self._like = keys.new_empty(0)  # what a read's placeholders are made like
            self.head_dims = (keys.shape[1], keys.shape[3], values.shape[3])
            slot_fields = {"pos": keys.new_empty(keys.shape[:3], dtype=torch.int64)}
            if self.keeps_scores:
                slot_fields["score"] = keys.new_empty(keys.shape[:3], dtype=torch.float32)
            self._allocate({**self.codec.encode(keys[:, :, :1], values[:, :, :1]), **slot_fields}, _grown(new))
            if self.first and self.codec.packed(self.fields) is not None:  # full precision is exact already
                batch, heads = keys.shape[:2]
                self.exact = {name: x.new_zeros(batch, heads, self.first + 1, x.shape[3])
                              for name, x in (("k", keys), ("v", values))}  # fmt: skip
                if self.device_count:
                    mark_static(*self.exact.values())
        elif self.length + new > self.capacity:
            self._resize(_grown(self.length + new))
        self._write(self.length, keys, values, first_pos)
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

    def _write(self, lo: int, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> None:
        """Writes the tokens of `keys`/`values` at logical positions `first_pos ..` into slots `lo ..`, scores
        zeroed."""
        new = keys.shape[2]
        self.fresh = (lo, lo + new)
        if self.exact is not None:
            self._write_exact(first_pos, keys, values)
        if self.device_count:  # by index, as `_write_slots` says why (its positions come from the device count)
            slots = self._span_slots(lo, lo + new)
            self._write_slots(slots, {**self.codec.encode(keys, values), "pos": slots + (first_pos - lo), **self._zeroed})
            return
        span = slice(lo, lo + new)
        self.codec.write(self.fields, span, keys, values)
        if new == 1:  # a decode step: fill in place, no index tensor
            self.fields["pos"][:, :, span].fill_(first_pos)
        else:
            self.fields["pos"][:, :, span] = torch.arange(first_pos, first_pos + new, device=self.device)
        if self.keeps_scores:
            self.fields["score"][:, :, span].zero_()

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
        head, `[batch, kv_heads, slots + first]`, once the heads are not `aligned` (as `valid`)."""
        pos = self.positions if not self.aligned else self.positions[:, 0]
        region = torch.arange(self.first, device=pos.device)
        return torch.cat([pos >= self.first, (pos[..., None] == region).any(-2)], dim=-1)

    def _span_slots(self, lo: int, hi: int) -> torch.Tensor:
        """Slots `lo .. hi - 1` of every row and head, `[batch, kv_heads, hi - lo]`."""
        return torch.arange(lo, hi, device=self.device).expand(*self.pos.shape[:2], -1)

    def _refill(self, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> None:
        """The hole takes the one token of this append."""
        hole, self.hole = self.hole, None
        self.in_order = False
        if isinstance(hole, int):
            self._write(hole, keys, values, first_pos)
            return
        self.fresh = self._carried("fresh", hole)
        if self.exact is not None:
            self._write_exact(first_pos, keys, values)
        if self.device_count:
            self._write_slots(hole, {**self.codec.encode(keys, values), "pos": first_pos, **self._zeroed})
            return
        self.codec.write_at(self.fields, hole, keys, values)
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
            read = SlotRead(keys, values, self.valid, packed, self.codec.fmt, self.slots)
            if self.exact is not None:
                exact_k, exact_v = (self.exact[name][:, :, : self.first] for name in ("k", "v"))
                read = read._replace(residual_k=exact_k, residual_v=exact_v, decode_mask=self.exact_mask)
        if not self.device_count:  # (a compileable store's read is made afresh, as its views: `used`)
            self._read = (used, read)
        return read

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
        with its prompt, which marks every slot)."""
        seen = self.seen_now()
        fresh_only = self.device_count and new == 1 and torch.compiler.is_compiling()
        if fresh_only:
            slots = self.fresh if isinstance(self.fresh, torch.Tensor) else self._span_slots(*self.fresh)
            pos = self.pos.gather(2, slots)
        else:
            pos = self.used()["pos"]
        hidden = hidden_slots(attention_mask, pos, seen)
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
        lead = self._lead
        if lead is None or lead[0] != n or lead[1] is not self.fields:  # the same slots every step: cut once
            cut = {name: self.fields[name][:, :, :n] for name in self.codec.key_fields if name in self.fields}
            lead = self._lead = (n, self.fields, cut)
        self.codec.write_keys(lead[2], None, keys)
        if self.exact is not None:  # (slots 0 .. n - 1 hold positions 0 .. n - 1 here: `SinkPolicy._shift_unpadded`)
            m = min(n, self.first)
            self.exact["k"][:, :, :m] = keys[:, :, :m]

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

    def mark_hidden(self, hidden: torch.Tensor) -> None:
        """Marks the used slots where `hidden` [batch, kv_heads, length] is True as padding (`pos` PAD): attention
        masks them from now on and every policy evicts them first."""
        if self.device_count:  # by index, as `_write_slots` says why
            pos = self.used()["pos"]
            self._write_slots(self._span_slots(0, self.length), {"pos": pos.masked_fill(hidden, PAD)})
        else:
            self.used()["pos"].masked_fill_(hidden, PAD)

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

    def formats(self) -> tuple:
        fmt = getattr(self.codec, "fmt", None)  # (a dense codec has none)
        return () if fmt is None else (fmt,)

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

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot tensors by name, and the exact region's (`exact_k`, `exact_v`): what an offloading placement
        moves."""
        exact = {f"exact_{name}": held for name, held in (self.exact or {}).items()}
        return {**self.fields, **exact}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.fields = {name: held for name, held in tensors.items() if not name.startswith("exact_")}
        if self.exact is not None:
            self.exact = {name: tensors[f"exact_{name}"] for name in self.exact}

    def take_written(self) -> dict:
        """Slots are overwritten anywhere (evictions): a changed field is written back whole."""
        return {}

    def memory(self) -> MemoryReport:
        if not self.fields:
            return MemoryReport()
        per_slot = {name: held[:, :, :1].numel() * held.element_size() for name, held in self.fields.items()}
        payload = sum(per_slot[name] for name in self.codec.payload)
        metadata = sum(per_slot.values()) - payload
        held = min(self.held, self.seen)  # (a compileable store's free slots are not tokens)
        exact = sum(x.numel() * x.element_size() for x in (self.exact or {}).values())
        return MemoryReport(
            payload_bytes=payload * held + exact,
            reserved_bytes=payload * (self.capacity - held),
            metadata_bytes=metadata * self.capacity,
            batch_size=self.batch_size,
        )

    def quantized_part(self) -> tuple[MemoryReport, int]:
        """Bytes of the coded tokens held (codes as payload, scales and zeros as metadata) and their count per row: the
        held tokens less the exact region's (whose slots' codes are not read); nothing at full precision."""
        if not self.fields or self.codec.packed(self.fields) is None:
            return MemoryReport(), 0
        per_slot = {name: held[:, :, :1].numel() * held.element_size() for name, held in self.fields.items()}
        coded = min(self.held, self.seen) - self.exact_part()[0]
        payload = sum(per_slot[name] for name in self.codec.payload)
        metadata = sum(size for name, size in per_slot.items() if name not in self.codec.payload and name not in ("pos", "score"))
        return MemoryReport(payload_bytes=payload * coded, metadata_bytes=metadata * coded, batch_size=self.batch_size), coded

    def exact_part(self) -> tuple[int, int]:
        """Tokens per row held at full precision (every one at full precision, else the exact region's), and bytes per
        element there."""
        if not self.fields:
            return 0, 0
        if self.exact is None:
            full = self.codec.packed(self.fields) is None
            return (min(self.held, self.seen) if full else 0), self.fields["keys"].element_size() if full else 0
        return min(self.first, self.seen, self.held), self.exact["k"].element_size()

    def _write_slots(self, slots: torch.Tensor, parts: dict[str, torch.Tensor | float]) -> None:
        """`fields[name][:, :, slots] = parts[name]` for each part, `slots` [batch, kv_heads, k].

        Written by `index_put_` with (row, head, slot) indices: a compiled graph updates the fields in place even
        when a step writes one twice with reads between (a refill or an append, then an eviction); a slice
        assignment, a `scatter_` or an `index_copy_` into a flat view made it copy whole buffers every step, so a
        compileable store (`device_count`) writes every span through here too, its eager steps as its compiled ones.
        Otherwise a scalar (a position, a zeroed score, PAD) goes into a per-slot field by `scatter_` with the value:
        a third of a `torch.tensor` plus `index_put_`.
        """
        index = None
        for name, part in parts.items():
            field = self.fields[name]
            if not isinstance(part, torch.Tensor):
                if not self.device_count and field.ndim == slots.ndim:  # a scalar: one op and no tensor to make
                    field.scatter_(2, slots, part)
                    continue
                part = torch.tensor(part, dtype=field.dtype, device=field.device)
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

    def _check_compatible(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`check_fits`, once per buffers and new tokens' shapes (`EagerMemo`; new fields have a new `pos`)."""
        self._fits.get((keys.shape, values.shape, keys.dtype, keys.device), self._check_fits, keys, values,
                       anchor=self.fields["pos"])  # fmt: skip

    def _check_fits(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        check_fits(keys, values, (self.batch_size, *self.head_dims), self.dtype, self.device)
