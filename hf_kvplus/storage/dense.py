"""Dense full-precision storage: one growable buffer per layer, appended in place."""

from __future__ import annotations

import torch

from ..errors import CapacityError, ConfigError, UnsupportedOperationError
from ..memory import MemoryReport
from ..static_address import mark_static
from .base import KVStorage, Region, check_fits, widened
from .eager_memo import EagerMemo
from .reads import DenseRead
from .token_count import TokenCount, counted

#: Capacity is allocated in multiples of this many tokens.
GRANULE = 64


def _round_up(n: int, granule: int = GRANULE) -> int:
    return -(-n // granule) * granule


def _grown(tokens: int) -> int:
    """The capacity to allocate for `tokens`: an eighth more (at least a granule), rounded up."""
    return _round_up(tokens + max(tokens // 8, GRANULE))


class DenseStorage(KVStorage):
    """K/V kept as `[batch, kv_heads, capacity, head_dim]` buffers holding tokens `start:end`.

    Appending writes into headroom instead of concatenating (Transformers' `DynamicCache` copies the
    whole layer on every step); when it runs out, the buffers grow by an eighth of what is needed (at
    least one granule of 64 tokens), so a decode step costs amortized O(1) copies while at most about
    an eighth of the bytes at rest is headroom. Dropping old tokens (windows, eviction) only moves `start`; the held tokens are moved
    back to the front when headroom runs out. The views handed to attention are slices of the buffers,
    not copies.

    `max_tokens` fixes the capacity: the buffers are allocated once and appending past it raises
    `CapacityError`, leaving the storage as it was. `static=True` (with `max_tokens`, as Transformers'
    StaticCache) reads the whole buffer every time, token t at position t, unwritten positions zero and
    masked by the model: every decode step has the same shapes, so a compiled decode never recompiles. Such a
    storage counts its tokens on the device too (`TokenCount`) and writes at the positions counted there, into
    buffers at static addresses, so that a compiled step reads and writes no Python int and one CUDA graph serves
    every step (past `max_tokens`, a compiled step's write fails on the device, as StaticCache's does).
    """

    def __init__(self, max_tokens: int | None = None, static: bool = False):
        if static and max_tokens is None:
            raise ConfigError("a static dense storage needs max_tokens: it reads that many positions every step")
        self.max_tokens = max_tokens
        self.static_length = max_tokens if static else None
        self.device_count = static
        self.count = TokenCount()  # `end`; a static storage's on the device too
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.start = self.end = 0
        self._written: tuple[int, int] | None = None  # tokens written in place since take_written()
        self._fits = EagerMemo()  # `check_fits` passed for the keys buffer and new tokens of these shapes

    end = counted("Tokens start..end-1 are held (`count`; a static storage's on the device too).")

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def batch_size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        new = keys.shape[2]
        if self.keys is None:
            self._allocate(keys, values, self.max_tokens or _round_up(max(new, 1)))
        else:
            self._check_compatible(keys, values)
        if self.device_count:  # at the positions counted on the device, as a compiled step writes
            self.count.check_room(new, self.max_tokens)
            positions = self.count.positions(new)
            self.keys.index_copy_(2, positions, keys)
            self.values.index_copy_(2, positions, values)
            self.count.advance(new)
            return
        end = self.end
        if end + new > self.capacity:
            self._make_room(new)
            end = self.end
        self.keys[:, :, end : end + new] = keys
        self.values[:, :, end : end + new] = values
        self._note_written(end, end + new)
        self.end = end + new

    def view(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.end
        return self.keys[:, :, end - last : end], self.values[:, :, end - last : end]

    def read(self, last: int, new: int) -> DenseRead:
        if self.static_length is not None:
            return DenseRead(self.keys, self.values)
        return DenseRead(*self.view(last))

    def drop_front(self, count: int) -> None:
        if self.static_length is not None:
            raise UnsupportedOperationError(
                f"a static dense storage keeps token t at position t; it cannot drop its {count} oldest tokens"
            )
        self.start += count
        if self.start == self.end:
            self.start = self.end = 0
        self._shrink()

    def drop_after(self, first: int, count: int) -> None:
        """Forgets the `count` tokens after the oldest `first` (a pinned prefix, which stays in front)."""
        if first:
            s = self.start
            self.keys[:, :, s + count : s + count + first] = self.keys[:, :, s : s + first].clone()
            self.values[:, :, s + count : s + count + first] = self.values[:, :, s : s + first].clone()
            self._note_written(s + count, s + count + first)
        self.drop_front(count)

    def drop_back(self, count: int) -> None:
        self.end -= count
        if self.start == self.end:
            self.start = self.end = 0

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.keys is None:
            return
        indices = indices.to(self.keys.device)
        if indices.numel() == self.keys.shape[0]:
            # Same batch size (beam reorder): permute the held tokens in place, keep the headroom.
            held = slice(self.start, self.end)
            self.keys[:, :, held] = self.keys[indices, :, held]
            self.values[:, :, held] = self.values[indices, :, held]
            self._note_written(self.start, self.end)
        else:
            self.keys = self.keys.index_select(0, indices)
            self.values = self.values.index_select(0, indices)
        if self.device_count:
            mark_static(self.keys, self.values)

    def reset(self) -> None:
        self.keys = self.values = None
        self.start = self.end = 0

    def memory(self) -> MemoryReport:
        if self.keys is None:
            return MemoryReport()
        per_token = (self.keys[:, :, :1].numel() + self.values[:, :, :1].numel()) * self.keys.element_size()
        return MemoryReport(
            payload_bytes=per_token * self.length,
            reserved_bytes=per_token * (self.capacity - self.length),
            batch_size=self.batch_size,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.keys, self.values = tensors.get("keys"), tensors.get("values")

    def take_written(self) -> dict[str, Region]:
        written, self._written = self._written or (0, 0), None
        return {} if self.keys is None else {"keys": (2, *written), "values": (2, *written)}

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        batch, heads, _, dim = keys.shape
        # A static storage's unwritten positions are read (and masked): they must hold finite numbers.
        static = self.static_length is not None
        self.keys = (keys.new_zeros if static else keys.new_empty)(batch, heads, capacity, dim)
        self.values = (values.new_zeros if static else values.new_empty)(batch, heads, capacity, values.shape[-1])
        if static:
            mark_static(self.keys, self.values)
            if self.count.tensor is None:
                self.count.place(keys.device)

    def _check_compatible(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`check_fits`, once per buffer and new tokens' shapes (`EagerMemo`)."""
        self._fits.get((keys.shape, values.shape, keys.dtype, keys.device), self._check_fits, keys, values,
                       anchor=self.keys)  # fmt: skip

    def _check_fits(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        held = self.keys
        check_fits(keys, values, (held.shape[0], held.shape[1], held.shape[3], self.values.shape[3]), held.dtype,
                   held.device)  # fmt: skip

    def _make_room(self, new: int) -> None:
        needed = self.length + new
        if self.max_tokens is not None:
            if needed > self.max_tokens:
                raise CapacityError(
                    f"appending {new} tokens to {self.length} held needs {needed} slots; "
                    f"max_tokens is {self.max_tokens}"
                )
            capacity = self.max_tokens
        elif _grown(needed) <= self.capacity:
            capacity = self.capacity  # moving the held tokens to the front leaves enough headroom
        else:
            capacity = _grown(needed)
        self._move_to_front(capacity)

    def shrink_to_fit(self) -> None:
        if self.keys is not None and self.max_tokens is None and self.capacity > _grown(self.length):
            self._move_to_front(_grown(self.length))

    def _shrink(self) -> None:
        """Gives back headroom far larger than what is held (after a long prefill through a window)."""
        if self.max_tokens is None and self.capacity > 2 * _grown(self.length):
            self._move_to_front(_grown(self.length))

    def _move_to_front(self, capacity: int) -> None:
        if capacity == self.capacity and self.start == 0:
            return
        held_k = self.keys[:, :, self.start : self.end]
        held_v = self.values[:, :, self.start : self.end]
        if capacity != self.capacity:
            self._allocate(held_k, held_v, capacity)
        elif self.start < self.length:  # source and destination overlap
            held_k, held_v = held_k.clone(), held_v.clone()
        self.keys[:, :, : self.length] = held_k
        self.values[:, :, : self.length] = held_v
        self._note_written(0, self.length)
        self.start, self.end = 0, self.length

    def _note_written(self, lo: int, hi: int) -> None:
        self._written = widened(self._written, lo, hi)

