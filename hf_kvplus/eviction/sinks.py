"""StreamingLLM: the first real tokens of each row (attention sinks) plus a recent window."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..static_address import mark_static
from ..storage.slots import SlotStore
from .declare import Setting, compress_setting
from .policy import KEEP, EvictionPolicy, check_compress, padding_and_recent
from .rope import RotaryShift

POSITIONS = ("cache", "original")


class SinkPolicy(EvictionPolicy, name="sink"):
    """Keeps `num_sinks` first real tokens and the `window` newest, evicting the oldest in between.

    With `positions="cache"` the distance between a query and each kept key is its distance inside
    the cache: the window is contiguous with the queries, so only the sinks move, by the number of
    tokens evicted after them. Their keys are re-rotated from the copy taken before the first
    eviction (one rotation, no drift), so the model never sees a distance larger than the budget.
    """

    is_croppable = True
    uniform = True  # it ranks by position, the same in every head
    settings = (Setting("num_sinks", int, 4, minimum=0), Setting("positions", str, "cache", choices=POSITIONS),
                compress_setting("always"))  # fmt: skip
    positional = ("num_sinks", "window")  # (a spec's window: tokens after the sinks, or a share of the prompt for both)
    compileable = True
    keeps_scores = False  # it evicts by position
    counts_hidden = True

    @classmethod
    def prepare(cls, config, options: dict) -> dict:
        """The model's rotary parameters, when the sinks move (`positions="cache"`)."""
        moving = options["positions"] == "cache" and options["num_sinks"]
        return {**options, "rotary": RotaryShift.from_config(config) if moving else None}

    @classmethod
    def for_layer(cls, spec, tokens: int, options: dict) -> SinkPolicy:
        sinks = options["num_sinks"]
        if tokens <= sinks:
            raise ConfigError(f"a budget of {tokens} tokens leaves no window after num_sinks={sinks} (the recent window "
                              f"must hold at least 1 token, got window={tokens - sinks}): give a budget >= num_sinks + 1 "
                              f"= {sinks + 1}")  # fmt: skip
        return cls(sinks, tokens - sinks, options["rotary"], options["compress"])

    def check_first(self, first_tokens: int) -> None:
        if isinstance(first_tokens, int) and first_tokens > self.num_sinks:
            raise ConfigError(
                f"first_tokens={first_tokens} exceeds num_sinks={self.num_sinks}: a SinkCache keeps the first "
                f"{self.num_sinks} tokens of each row (and moves only those when positions='cache'); give first_tokens "
                f"<= num_sinks"
            )

    def __init__(self, num_sinks: int, window: int, rotary: RotaryShift | None, compress: str = "always"):
        self.compress = check_compress(compress)
        if num_sinks < 0:
            raise ConfigError(f"num_sinks must be >= 0, got {num_sinks}")
        if window < 1:
            raise ConfigError(f"the recent window must hold at least 1 token, got window={window}")
        self.num_sinks, self.window, self.rotary = num_sinks, window, rotary
        self.budget = num_sinks + window
        self.sink_keys: torch.Tensor | None = None  # [batch, kv_heads, num_sinks, head_dim], unshifted
        self.captured: torch.Tensor | None = None  # [batch] bool: sink_keys holds this row's sinks
        self._prepared: tuple | None = None  # sink_keys as `RotaryShift.prepare` gives them (unpadded rows)
        self._ring: tuple[int, int] | None = None  # the last victim's slot and the store's layout version then
        self._in_place = False  # sink_keys and captured are `prepare_compiled`'s static buffers

    def victim(self, store: SlotStore) -> int | None:
        """The oldest window token's slot, while every row is real from position 0 (sinks in slots 0..)
        and the slot layout is known: in position order, or a ring of `window + 1` slots after the sinks
        that the last victim's slot, refilled by the newest token, walks around. Not for a compileable store, whose
        compiled graph would take the slot as an int input (one CUDA graph recorded per slot): it ranks by position,
        on the device."""
        if store.device_count or store.first_real is not None or store.length != self.budget + 1:
            self._ring = None
            return None
        if store.in_order:
            slot = self.num_sinks
        elif self._ring is not None and self._ring[1] == store.version:
            slot = self.num_sinks + (self._ring[0] - self.num_sinks + 1) % (self.window + 1)
        else:
            return None
        self._ring = (slot, store.version)
        return slot

    def score(self, store: SlotStore) -> torch.Tensor:
        pos = store.positions
        ranks = pos.float().masked_fill(self._is_sink(pos, store.first_real), KEEP)
        return padding_and_recent(store, self.window, ranks)

    def prepare_compiled(self, store: SlotStore) -> None:
        """The sinks' copy and which rows have one, made here, eagerly, at static addresses: compiled steps update
        them in place (a graph that made them would return them, and a CUDA graph's next replay overwrites what it
        returned); and the rotary frequencies moved to the device (a CPU tensor keeps a graph from CUDA graphs)."""
        if self.rotary is None or not self.num_sinks:
            return
        self.rotary.place(store.device)
        if self.sink_keys is None:
            batch, heads, key_dim = store.batch_size, store.head_dims[0], store.head_dims[1]
            self.sink_keys = torch.zeros(batch, heads, self.num_sinks, key_dim, dtype=store.dtype, device=store.device)
            self.captured = torch.zeros(batch, dtype=torch.bool, device=store.device)
            mark_static(self.sink_keys, self.captured)
            self._in_place = True

    def after_evict(self, store: SlotStore) -> None:
        if self.rotary is None or not self.num_sinks:
            return
        if store.device_count:  # every row's sinks found on the device (unpadded rows start at 0), state in place
            first_real = store.first_real
            self._shift_padded(store, store.pos.new_zeros(store.batch_size) if first_real is None else first_real)
        elif store.first_real is None:
            self._shift_unpadded(store)
        else:
            self._shift_padded(store, store.first_real)

    def _shift_unpadded(self, store: SlotStore) -> None:
        """Every slot holds a real token: the sinks are positions 0.. in slots 0.. (compaction keeps
        position order and sinks are never evicted), and all rows moved by the same count. (A store that counts on
        the device goes through `_shift_padded`: this one counts in Python ints.)"""
        shift = store.seen - store.held  # real tokens evicted
        if shift <= 0:
            return
        if self.sink_keys is None:  # the first move: copy the sinks before they ever change
            slots = torch.arange(self.num_sinks, device=store.device).expand(*store.pos.shape[:2], -1)
            self.sink_keys = self._rotatable(store, store.read_keys(slots))  # a gather: a copy (slots are rewritten)
            self.captured = torch.ones(store.batch_size, dtype=torch.bool, device=store.device)
        if self._prepared is None:
            self._prepared = self.rotary.prepare(self.sink_keys)
        exact = store.leading_exact(self.num_sinks)
        if exact is not None:  # exact sinks alone (quantized slots' default): rotated straight into their copies
            self.rotary.rotate_prepared(self._prepared, shift, exact.dtype, out=exact)
        else:
            store.write_leading_keys(self.rotary.rotate_prepared(self._prepared, shift, self.sink_keys.dtype))

    def _shift_padded(self, store: SlotStore, first_real: torch.Tensor) -> None:
        """Rows differ in where their real tokens start: the same rule per row, on the device."""
        pos = store.positions
        real_held = (pos[:, 0] >= 0).sum(-1)
        shift = (store.seen_now() - first_real.clamp(min=0)) - real_held  # real tokens evicted per row
        if store.hidden is not None:  # masked ones are not evicted: the window keeps their gap, the sinks do not close it
            shift = shift - store.hidden
        moving = (shift > 0) & (first_real >= 0)
        # Slot of sink i: where pos == first_real + i, the same slot in every head (sinks never move). A sink a mask hid
        # since is held by no slot: nothing is written for it.
        targets = first_real.clamp(min=0)[:, None] + torch.arange(self.num_sinks, device=pos.device)
        match = pos[:, 0, None, :] == targets[:, :, None]
        slots = match.int().argmax(-1)
        slots = slots[:, None, :].expand(-1, pos.shape[1], -1)
        held = store.read_keys(slots)
        if self.sink_keys is None:
            self.sink_keys = torch.zeros_like(held)
            self.captured = torch.zeros_like(moving)
        # A row's sinks are copied at its first eviction of a real token, before they ever move.
        fresh = moving & ~self.captured
        sink_keys = torch.where(fresh[:, None, None, None], self._rotatable(store, held, fresh), self.sink_keys)
        captured = self.captured | moving
        if self._in_place:
            self.sink_keys.copy_(sink_keys)
            self.captured.copy_(captured)
        else:
            self.sink_keys, self.captured = sink_keys, captured
        self._prepared = None
        rows = moving[:, None] & match.any(-1) if store.hidden is not None else moving
        store.write_keys(slots, self.rotary.rotate(self.sink_keys, shift.clamp(min=0)), rows=rows)

    def _rotatable(self, store: SlotStore, keys: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`keys` as the sinks' copy keeps them. Codes that hold each element up to a limit (`value_range`: integer and
        fp8 slots) would overflow where a rotation takes an element past it, so a rotary pair whose norm is past the
        limit is kept as 0 and counted by the store's `RangeGuard` (for `rows` only: a padded store copies rows as
        they first move), reported at the next prompt or `quantized_report()`. Rotated formats code norms, which a
        rotation keeps."""
        guard = store.range_guard
        if guard is None or guard.by_norm:
            return keys
        ok = self.rotary.holds(keys, guard.limit)
        guard.add((~ok if rows is None else ~ok & rows[:, None, None, None]).sum())
        return torch.where(ok, keys, 0)

    def _is_sink(self, pos: torch.Tensor, first_real: torch.Tensor | None) -> torch.Tensor:
        if first_real is None:
            return pos < self.num_sinks
        start = first_real.clamp(min=0)[:, None, None]
        return (first_real[:, None, None] >= 0) & (pos >= start) & (pos < start + self.num_sinks)

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.sink_keys is not None:
            indices = indices.to(self.sink_keys.device)
            self.sink_keys = self.sink_keys.index_select(0, indices)
            self.captured = self.captured.index_select(0, indices)
            if self._in_place:
                mark_static(self.sink_keys, self.captured)
            self._prepared = None

    def reset(self) -> None:
        self.sink_keys = self.captured = self._prepared = self._ring = None
        self._in_place = False

    def __repr__(self) -> str:
        where = "original" if self.rotary is None else "cache"
        compress = ", compress='prefill'" if self.compress == "prefill" else ""
        return f"SinkPolicy(num_sinks={self.num_sinks}, window={self.window}, positions={where!r}{compress})"
