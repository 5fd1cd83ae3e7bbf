"""Static quantized storage: KIVI codes for a fixed number of positions and a full-precision ring window,
read whole at every step so that a compiled decode never changes shape."""

from __future__ import annotations

from functools import partial

import torch

from ..errors import CacheMismatchError, ConfigError, UnsupportedOperationError
from ..kernels.dispatch import quantize_keys, quantize_values
from ..kernels.kv_format import state_kw
from ..kernels.quant_format import PackedKV, QuantFormat
from ..memory import MemoryReport, tensor_bytes
from ..static_address import mark_static
from .base import KVStorage
from .eager_memo import EagerMemo
from .reads import PackedRead, Read, placeholders
from .token_count import TokenCount, counted
from .value_range import RangeGuard, code_limit


class StaticQuantizedStorage(KVStorage):
    """Token t's codes at position t of the code buffers; the newest tokens also in a ring.

    The format is `QuantizedStorage`'s (keys per channel over groups of tokens, values per token), and so is
    what is quantized when: once `n` tokens are held, the groups before `frontier(n) = (n - window) // G * G`
    are quantized, the rest are exact. Exact tokens live in a ring of `window + 2G` slots (token p in slot
    p % ring), which also keeps the last quantized group's tokens. A decode step writes its token into the
    ring and quantizes, from the ring, the newest key group that has left the window and the one value that
    has just left it (values are coded as they leave, ahead of the frontier that makes them read), at
    positions computed on the device: a step that completes a group and one that does not run the same ops
    (re-quantizing a group gives the same codes), so one compiled graph serves every step.

    A rotated format's key centre may turn with RoPE (`kernels/turning_center.py`): token p is coded and read at code
    position p, so its centre is the one at position p, set from the first keys at their positions.

    The ring holds tokens as the format's `to_ring` makes them (a rotated format's rotated, ``x @ R`` in the model's
    dtype: one rounding), so that a step
    rotates only its new token: the tokens leaving the window are coded as the ring holds them, and attention reads
    the ring as it is (it attends in the rotated space); `view` rotates them back.

    Only tokens that leave the window are coded, and with `max_tokens` held the newest `window` never do: the code
    buffers hold `max_tokens - window` positions (whole groups, at least one), which every step reads and decodes.

    With `first`, tokens p < `first` (the head) stay exact in `first` slots before the ring (slot p), never in the
    ring nor read from their codes, which the mask hides (a key group still codes them with its other tokens).

    Attention reads all positions every step: the code positions then the head and the ring, with a mask of its own
    (codes before the frontier, ring slots holding a token at or past it) combined with the model's (padding).
    `static_length` is codes plus ring, the length the model's mask is built for; prefill reads the same
    length densely, its tokens at their positions (the fresh ones and the `window - 1` before them exact: each
    query's window) and the ring's part empty, so the model's causal mask is right as it is.
    """

    reads_in_place = True
    device_count = True

    def __init__(self, fmt: QuantFormat, window: int, max_tokens: int, first: int = 0, state=None):
        g = fmt.group_size
        if isinstance(window, bool) or not isinstance(window, int) or window < g:
            raise ConfigError(
                f"the full-precision window ({window!r} tokens) must be an int of at least one group ({g} tokens)"
            )
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < max_tokens:
            raise ConfigError(f"the full-precision first tokens must be an int in 0..max_tokens-1, got {first!r}")
        self.fmt, self.window, self.max_tokens, self.first = fmt, window, max_tokens, first
        self.state = state  # the layer's state of the format (`KVFormat.make_state`: a rotated format's key centre)
        self.code_fmt = fmt.ring_format()  # what codes the ring's tokens
        self.positions = max(g, -(-(max_tokens - window) // g) * g)  # code positions: whole groups
        self.ring = window + 2 * g
        self.static_length = self.positions + first + self.ring
        self.count = TokenCount()  # `end`: tokens held (token p at code position p), on the device for decode steps
        self.range_guard = RangeGuard(*code_limit(fmt))  # what a decode step gives that the codes cannot hold
        self.buffers: PackedKV | None = None
        self.ring_k: torch.Tensor | None = None
        self.ring_v: torch.Tensor | None = None
        self._aranges = EagerMemo()  # positions, ring, group, head (`_ranges`), for the ring's device
        # The last chunk after the past's window: what the chunk attends exact (`_with_past_window`).
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ state
    end = counted("Tokens held, token p at code position p (`count`, on the device too).")

    @property
    def length(self) -> int:
        return self.end

    @property
    def batch_size(self) -> int:
        return 0 if self.ring_k is None else self.ring_k.shape[0]

    def frontier(self, held: int) -> int:
        """Tokens quantized once `held` tokens are held (whole groups; at least `window` stay exact)."""
        g = self.fmt.group_size
        return max(0, (held - self.window) // g * g)

    # ------------------------------------------------------------------ writes
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        new = keys.shape[2]
        if self.ring_k is None:
            self.fmt.check_head_dim(keys.shape[-1])
            self._allocate(keys, values)
        elif keys.shape[0] != self.batch_size:
            raise CacheMismatchError(f"new keys have batch {keys.shape[0]}, the cache holds {self.batch_size} rows")
        self.count.check_room(new, self.max_tokens)
        ring_k, ring_v = self.fmt.to_ring(keys, values, lambda: self.end, **state_kw(self.state))
        if new == 1:
            self._fresh = None
            self._decode_write(ring_k, ring_v)
        else:
            self._fresh = self._with_past_window(keys, values)
            self._chunk_write(ring_k, ring_v)
        self.count.advance(new)

    def _with_past_window(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's keys and values after the `window - 1` tokens before it, exact as the ring holds them: what the
        chunk's queries attend at full precision (each query's window), though the chunk pushes them out of it."""
        past = min(self.end, self.window - 1)
        if past == 0:
            return keys, values
        slots = self._slots(torch.arange(self.end - past, self.end, device=keys.device))
        k, v = self.fmt.from_ring(self.ring_k.index_select(2, slots), self.ring_v.index_select(2, slots),
                                  **state_kw(self.state))
        return torch.cat([k, keys], dim=2), torch.cat([v, values], dim=2)

    def _decode_write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One token: into the ring; then, from the ring, the newest key group out of the window quantized and the
        value that has just left it (values are coded per token: one, not a group), all at tensor positions."""
        g = self.fmt.group_size
        group = self._ranges()[2]
        token = self.count.positions(1)
        slot = self._slots(token)
        self.ring_k.index_copy_(2, slot, keys)
        self.ring_v.index_copy_(2, slot, values)
        guard = self.range_guard  # (counted once here; coded as 0 wherever the codes take it from the ring)
        guard.count(keys)
        guard.count(values)
        # Before the first group leaves the window this re-quantizes key group 0 from whatever the ring holds, and
        # value 0 from token 0: those codes are masked (the frontier is 0) and written again once they have left.
        index = ((token + 1 - self.window) // g - 1).clamp_(min=0)
        tokens = index * g + group
        self._quantize_keys(guard.clean(self.ring_k.index_select(2, self._slots(tokens))), tokens, index)
        left = (token - self.window).clamp_(min=0)
        self._quantize_values(guard.clean(self.ring_v.index_select(2, self._slots(left))), left)

    def _chunk_write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Prefill or a chunk (eager, as the ring holds it): the key groups it completes and the values that leave
        the window quantized from the ring and the chunk, which then leaves its last `ring` tokens in the ring."""
        g, new, ring = self.fmt.group_size, keys.shape[2], self.ring
        first, end = self.end, self.end + new
        lo = max(0, self.frontier(first) - g)  # the last group quantized may be completed by this chunk
        hi, left = self.frontier(end), max(0, end - self.window)  # hi <= left: values are coded up to `left`
        if left > lo:
            old = self._slots(torch.arange(lo, first, device=keys.device))
            tokens = torch.arange(lo, left, device=keys.device)
            if hi > lo:
                source_k = torch.cat([self.ring_k.index_select(2, old), keys], dim=2)[:, :, : hi - lo]
                self._quantize_keys(source_k, tokens[: hi - lo], tokens[: hi - lo : g] // g)
            source_v = torch.cat([self.ring_v.index_select(2, old), values], dim=2)[:, :, : left - lo]
            self._quantize_values(source_v, tokens)
        kept = min(new, ring)
        slots = self._slots(torch.arange(end - kept, end, device=keys.device))
        self.ring_k.index_copy_(2, slots, keys[:, :, new - kept :])
        self.ring_v.index_copy_(2, slots, values[:, :, new - kept :])
        head = min(end, self.first) - first  # the chunk's tokens of the head, which the ring's part may not reach
        if head > 0:
            self.ring_k[:, :, first : first + head] = keys[:, :, :head]
            self.ring_v[:, :, first : first + head] = values[:, :, :head]

    def _slots(self, tokens: torch.Tensor) -> torch.Tensor:
        """The buffer slots of `tokens`: the head's own (p < first), else the ring's (first + p % ring)."""
        if not self.first:
            return tokens % self.ring
        return torch.where(tokens < self.first, tokens, self.first + tokens % self.ring)

    def _quantize_keys(self, keys: torch.Tensor, tokens: torch.Tensor, groups: torch.Tensor) -> None:
        """Quantizes whole groups of exact keys into code positions `tokens` (key groups `groups`)."""
        b = self.buffers
        k, k_scale, k_zero = quantize_keys(keys.contiguous(), self.code_fmt, check=False, index=tokens[0],
                                           state=self.state)  # fmt: skip
        b.k.index_copy_(2, tokens, k)
        b.k_scale.index_copy_(2, groups, k_scale)
        if b.k_zero is not None:
            b.k_zero.index_copy_(2, groups, k_zero)

    def _quantize_values(self, values: torch.Tensor, tokens: torch.Tensor) -> None:
        """Quantizes exact values into code positions `tokens`."""
        b = self.buffers
        v, v_scale, v_zero = quantize_values(values.contiguous(), self.code_fmt, check=False)
        b.v.index_copy_(2, tokens, v)
        b.v_scale.index_copy_(2, tokens, v_scale)
        if b.v_zero is not None:
            b.v_zero.index_copy_(2, tokens, v_zero)

    # ------------------------------------------------------------------ reads
    def read(self, last: int, new: int) -> Read:
        fresh, self._fresh = self._fresh, None
        batch, heads, _, dim = self.ring_k.shape
        keys, values = placeholders(self.ring_k, batch, heads, self.static_length, dim, self.ring_v.shape[-1])
        return PackedRead(
            keys, values, self.buffers, self.code_fmt, 0, self.positions, self.ring_k, self.ring_v, None,
            partial(self._dense, fresh), mask=self._mask, state=self.state,
        )  # fmt: skip

    def _mask(self, model_mask: torch.Tensor | None) -> torch.Tensor:
        """The decode kernel's `[batch, positions + ring]` mask: codes before the frontier, ring slots holding a
        token at or past it, each where the model's mask (causal, padding) allows that token."""
        positions, slots, _, head = self._ranges()
        g, ring, first = self.fmt.group_size, self.ring, self.first
        token = self.count.positions(1) - 1  # the query's position
        frontier = ((token + 1 - self.window) // g * g).clamp_(min=0)
        held = token - (token - slots) % ring  # the token in each ring slot (negative: none yet)
        coded, exact = positions < frontier, (held >= frontier) & (held >= first)
        if first:
            coded = coded & (positions >= first)
            exact = torch.cat([head <= token, exact])  # the head's slots hold tokens 0..first-1
            held = torch.cat([head, held])
        if model_mask is None:
            return torch.cat([coded, exact]).expand(self.batch_size, -1)
        allowed = model_mask.gather(1, held.clamp(min=0).expand(model_mask.shape[0], -1))
        return torch.cat([model_mask[:, : self.positions] & coded, allowed & exact], dim=1)

    def _ranges(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`arange`s of the code positions, the ring's slots and a group's tokens. Kept between eager steps; made
        inside a compiled graph, where inductor folds them into its loops' indices (kept ones would be inputs,
        guarded at every step, and inductor fuses the decode step's kernels less well around them)."""
        return self._aranges.get(self.ring_k.device, self._make_ranges)

    def _make_ranges(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        device = self.ring_k.device
        return tuple(torch.arange(n, device=device) for n in (self.positions, self.ring, self.fmt.group_size, self.first))

    def _dense(self, fresh: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """All `static_length` positions densely: tokens at their positions (codes dequantized before the
        frontier, exact after it, a chunk's `fresh` tokens and the window before them exact), zeros elsewhere and in
        the ring's part."""
        keys = self.ring_k.new_zeros(*self.ring_k.shape[:2], self.static_length, self.ring_k.shape[-1])
        values = self.ring_v.new_zeros(*self.ring_v.shape[:2], self.static_length, self.ring_v.shape[-1])
        k, v = self.view(self.end)
        keys[:, :, : self.end] = k
        values[:, :, : self.end] = v
        if fresh is not None:
            keys[:, :, self.end - fresh[0].shape[2] : self.end] = fresh[0]
            values[:, :, self.end - fresh[1].shape[2] : self.end] = fresh[1]
        return keys, values

    def view(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, frontier = self.end - last, self.frontier(self.end)
        exact_to = min(frontier, self.first)  # the head's tokens before the frontier: exact too
        parts = []
        if first < exact_to:
            parts.append(self._exact(first, exact_to))
        if max(first, exact_to) < frontier:
            parts.append(self._dequantized(max(first, exact_to), frontier))
        parts.append(self._exact(max(first, frontier), self.end))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)

    def _exact(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo .. hi - 1` from their exact slots (head or ring), in the model's space."""
        slots = self._slots(torch.arange(lo, hi, device=self.ring_k.device))
        return self.fmt.from_ring(self.ring_k.index_select(2, slots), self.ring_v.index_select(2, slots),
                                  **state_kw(self.state))

    def _dequantized(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.fmt.group_size
        a, z = lo // g * g, -(-hi // g) * g
        return self.buffers.span(g, a, z).dequantized(self.fmt, lo - a, hi - a, self.ring_k.dtype, index=a,
                                                            state=self.state)  # fmt: skip

    # ------------------------------------------------------------------ edits
    def drop_front(self, count: int) -> None:
        raise UnsupportedOperationError(
            f"a static quantized storage keeps token t at position t; it cannot drop its {count} oldest tokens"
        )

    def drop_back(self, count: int) -> None:
        """Rolls back `count` tokens. Where the frontier moves back, the tokens the ring must hold again (the
        last quantized group and those past it) return to it dequantized; they are quantized again later."""
        end = self.end - count
        g = self.fmt.group_size
        lo, hi = max(self.first, self.frontier(end) - g), max(0, self.frontier(self.end) - g)  # (the head stays)
        if hi > lo:
            k, v = self.fmt.to_ring(*self._dequantized(lo, hi), lambda: lo, **state_kw(self.state))
            slots = self._slots(torch.arange(lo, hi, device=k.device))
            self.ring_k.index_copy_(2, slots, k)
            self.ring_v.index_copy_(2, slots, v)
        self.end = end

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.ring_k is None:
            return
        indices = indices.to(self.ring_k.device)
        self.ring_k, self.ring_v = self.ring_k.index_select(0, indices), self.ring_v.index_select(0, indices)
        self.buffers = self.buffers.select_rows(indices)
        mark_static(*self.tensors().values())

    def formats(self) -> tuple:
        return (self.fmt,)

    def states(self) -> tuple:
        return (self.state,)

    def reset(self) -> None:
        self.buffers = self.ring_k = self.ring_v = self._fresh = None
        self.end = 0
        self.range_guard.take()  # (what it counted goes with the tokens)

    # ------------------------------------------------------------------ bytes
    def memory(self) -> MemoryReport:
        if self.ring_k is None:
            return MemoryReport()
        coded, _ = self.quantized_part()
        exact = self.end - self.frontier(self.end) + self.exact_part()[0]
        ring = self.ring_k[:, :, :exact].numel() + self.ring_v[:, :, :exact].numel()
        payload = coded.payload_bytes + ring * self.ring_k.element_size()
        allocated = tensor_bytes(list(self.tensors().values()))
        return MemoryReport(
            payload_bytes=payload, metadata_bytes=coded.metadata_bytes + tensor_bytes(list(self.fmt.state_tensors(self.state))),
            reserved_bytes=allocated - payload - coded.metadata_bytes, batch_size=self.batch_size,
        )  # fmt: skip

    def quantized_part(self) -> tuple[MemoryReport, int]:
        """Bytes of the quantized tokens (codes as payload, scales and zeros as metadata) and their count per row."""
        if self.buffers is None:
            return MemoryReport(), 0
        n = self.frontier(self.end)
        lo = min(self.first, n) // self.fmt.group_size * self.fmt.group_size  # the groups the head fills alone: none
        codes, params = self.buffers.span_bytes(self.fmt.group_size, lo, n)
        return MemoryReport(payload_bytes=codes, metadata_bytes=params, batch_size=self.batch_size), n - min(self.first, n)

    def exact_part(self) -> tuple[int, int]:
        """Tokens per row held at full precision outside the window (the head's, before the frontier), and bytes per
        element there."""
        return min(self.first, self.frontier(self.end)), 0 if self.ring_k is None else self.ring_k.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.ring_k is None:
            return {}
        return {**self.buffers.tensors(), "ring_k": self.ring_k, "ring_v": self.ring_v}

    def __getstate__(self) -> dict:
        return dict(self.__dict__)  # (a saved cache then restores it through `__setstate__`, as a copy does)

    def __setstate__(self, state: dict) -> None:
        """A copy or a loaded cache: what `_allocate` made eagerly beside the buffers and does not travel (a turning
        centre's position tables) is made again here, or the first compiled step would make it in its graph, at every
        step, and compile again once it had."""
        self.__dict__.update(state)
        if self.ring_k is not None:
            self.fmt.prepare_indices(self.positions, self.ring_k.device, **state_kw(self.state))

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = self.positions
        batch, heads, _, dim = keys.shape
        v_dim, device = values.shape[-1], keys.device
        # Zeros: positions not yet written are read (and masked) by every step; they must hold finite numbers.
        self.buffers = PackedKV.allocate(self.fmt, batch, heads, n, dim, v_dim, device, torch.zeros)
        self.ring_k = keys.new_zeros(batch, heads, self.first + self.ring, dim)
        self.ring_v = values.new_zeros(batch, heads, self.first + self.ring, v_dim)
        self.count.place(device)
        self.range_guard.place(device)
        self.fmt.prepare_indices(n, device, **state_kw(self.state))  # every step reads all code positions (a turning centre's basis)
        mark_static(*self.tensors().values())  # (a decode step writes them in place)
