"""hf_kvplus's own quantized segment: packed codes and float16 group scales in growable buffers."""

from __future__ import annotations

import torch

from ..errors import CacheMismatchError, ConfigError
from ..kernels.dispatch import quantize_keys, quantize_values
from ..kernels.quant_format import PACKED_NAMES, PackedKV, QuantFormat
from ..memory import MemoryReport, tensor_bytes
from .base import widened
from .quantized import QuantizedSegment
from .reads import Read, quantized_read


class PackedSegment(QuantizedSegment):
    """Quantized tokens as `[batch, kv_heads, capacity, ...]` code buffers in the `kernels.quant_format`
    layout, written by the quantize-and-pack kernel and read in place by the fused decode kernel.

    Tokens `start .. end - 1` of the buffers are held; groups are aligned to buffer multiples of the
    group size, so `end` is always on a group boundary while `start` may fall inside a group (the rest
    of that group stays until the next compaction). Buffers grow by an eighth (at least 64 tokens)
    and give back headroom far larger than what is held.
    """

    def __init__(self, fmt: QuantFormat, state=None):
        #: The format, and the layer's state of it (`KVFormat.make_state`: a rotated format's key centre).
        self.fmt, self.state = fmt, state
        #: Keys coded at their buffer index (`KVFormat.indexed_keys`: a turning key centre): the buffers are read from
        #: index 0 and never compacted (a full-attention layer drops no token from the front).
        self.turning = fmt.indexed_keys(state)
        self.buffers: PackedKV | None = None
        self.start = self.end = 0
        self.granule = fmt.group_size * -(-64 // fmt.group_size)
        self._written: tuple[int, int] | None = None  # tokens written in place since take_written()
        self._cut: tuple | None = None  # ((first, end) token span, buffers, their views): see `_groups`

    @property
    def length(self) -> int:
        return self.end - self.start

    def flush_tokens(self, window: int) -> int:
        return self.fmt.flush_tokens(window, self.unit)

    @property
    def front_offset(self) -> int:
        return self.start % self.fmt.group_size

    @property
    def batch_size(self) -> int:
        return 0 if self.buffers is None else self.buffers.k.shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self.buffers is None else self.buffers.k.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, same_rows: list[int] | None = None) -> None:
        n = keys.shape[2]
        if self.start >= self.end:
            self.start = self.end = 0
        if self.buffers is None:
            self.dtype = keys.dtype
            self._allocate(keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.device, self._grown(n))
        elif keys.shape[0] != self.batch_size:
            raise CacheMismatchError(f"new keys have batch {keys.shape[0]}, the cache holds {self.batch_size} rows")
        if self.end + n > self.capacity or self.capacity > 2 * self._grown(self.length + n):
            self._compact(self.length + n)
        g, e = self.fmt.group_size, self.end
        b = self.buffers
        quantize_keys(keys, self.fmt, out=_out(b.k[:, :, e : e + n], b.k_scale, b.k_zero, e // g, (e + n) // g), check=False,
                      index=e, state=self.state)  # fmt: skip
        quantize_values(values, self.fmt, out=_out(b.v[:, :, e : e + n], b.v_scale, b.v_zero, e, e + n), check=False)
        self._note_written(e, e + n)
        self.end += n

    def dequantized(self, first: int, last: int, dtype: torch.dtype | None = None):
        lo, hi = self.start + first, self.start + last
        a, b = self._groups(0 if self.turning else lo, hi)
        return b.dequantized(self.fmt, lo - a, hi - a, dtype or self.dtype, state=self.state)

    def read(self, first, count, recent_k, recent_v, dense) -> Read:
        lo = self.start + first
        a, groups = self._groups(0 if self.turning else lo, lo + count)
        return quantized_read(groups, self.fmt, lo - a, count, recent_k, recent_v, None, dense, self.state)

    def _groups(self, lo: int, hi: int) -> tuple[int, PackedKV]:
        """The whole groups holding tokens `lo .. hi - 1` as views of the buffers, and the first one's token;
        the views are made again only when the span or the buffers change (every slice is host work in a
        decode step, and the span moves once a group)."""
        g = self.fmt.group_size
        a, z = lo // g * g, -(-hi // g) * g
        cut = self._cut
        if cut is None or cut[0] != (a, z) or cut[1] is not self.buffers:
            cut = self._cut = ((a, z), self.buffers, self.buffers.span(g, a, z))
        return a, cut[2]

    def drop_front(self, count: int) -> None:
        if self.turning:
            raise ConfigError(
                f"dropping {count} tokens from the front would move codes made relative to a turning key centre at "
                "their buffer index (only full-attention layers take one)"
            )
        self.start += count  # the next append compacts (or empties) the buffers

    def truncate(self, keep: int) -> None:
        self.end = self.start + keep
        if keep == 0:
            self.start = self.end = 0

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.buffers is None:
            return
        indices = indices.to(self.buffers.k.device)
        tensors = {name: getattr(self.buffers, name) for name in PACKED_NAMES}
        if indices.numel() == self.batch_size:
            g = self.fmt.group_size
            a = self.start // g * g
            for name, t in tensors.items():
                if t is not None:
                    rows = slice(a // g, self.end // g) if name in ("k_scale", "k_zero") else slice(a, self.end)
                    t[:, :, rows] = t[indices, :, rows]
            self._note_written(a, self.end)
        else:
            self.buffers = self.buffers.select_rows(indices)

    def reset(self) -> None:
        self.buffers = None
        self.start = self.end = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.buffers is None else self.buffers.tensors()

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.buffers = PackedKV(**{name: tensors.get(name) for name in PACKED_NAMES}) if tensors else None

    def take_written(self) -> dict[str, tuple[int, int, int]]:
        (lo, hi), self._written = self._written or (0, 0), None
        g = self.fmt.group_size
        return {
            name: (2, lo // g, -(-hi // g)) if name in ("k_scale", "k_zero") else (2, lo, hi)
            for name in self.tensors()
        }

    def _note_written(self, lo: int, hi: int) -> None:
        self._written = widened(self._written, lo, hi)

    def memory(self) -> MemoryReport:
        """The codes' bytes and the layer's state the format holds (a key centre), as metadata."""
        if self.buffers is None:
            return MemoryReport()
        return self.quantized_part()[0] + MemoryReport(metadata_bytes=tensor_bytes(list(self.fmt.state_tensors(self.state))))

    def quantized_part(self) -> tuple[MemoryReport, int]:
        """The codes' bytes alone (payload, scales and zeros, headroom), and the tokens they hold per row."""
        if self.buffers is None:
            return MemoryReport(), 0
        b, g = self.buffers, self.fmt.group_size
        allocated = tensor_bytes([getattr(b, n) for n in PACKED_NAMES])
        if self.length == 0:
            return MemoryReport(reserved_bytes=allocated, batch_size=self.batch_size), 0
        payload, metadata = b.span_bytes(g, self.start // g * g, self.end)
        return MemoryReport(
            payload_bytes=payload,
            metadata_bytes=metadata,
            reserved_bytes=allocated - payload - metadata,
            batch_size=self.batch_size,
        ), self.length

    def _grown(self, tokens: int) -> int:
        n = tokens + max(tokens // 8, self.granule)
        return -(-n // self.granule) * self.granule

    def _allocate(self, batch, heads, dim, v_dim, device, capacity) -> None:
        self.buffers = PackedKV.allocate(self.fmt, batch, heads, capacity, dim, v_dim, device)

    def _compact(self, needed: int) -> None:
        """Moves the held groups to the front of buffers sized for `needed` tokens (plus headroom)."""
        g, old = self.fmt.group_size, self.buffers
        a = self.start // g * g
        held = self.end - a
        capacity = self._grown(needed + self.start - a)
        b = old.k
        dims = self.fmt.channels(b.shape[-1], "keys"), self.fmt.channels(old.v.shape[-1], "values")
        self._allocate(b.shape[0], b.shape[1], *dims, b.device, capacity)
        for name in PACKED_NAMES:
            src, dst = getattr(old, name), getattr(self.buffers, name)
            if src is not None:
                grouped = name in ("k_scale", "k_zero")
                lo, n = (a // g, held // g) if grouped else (a, held)
                dst[:, :, :n] = src[:, :, lo : lo + n]
        self.start, self.end = self.start - a, held


def _out(codes, scale, zero, lo, hi):
    return codes, scale[:, :, lo:hi], None if zero is None else zero[:, :, lo:hi]

