"""Quantized storage: a quantized segment of old tokens plus a full-precision recent window (KIVI)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from functools import partial

import torch

from ..errors import CapacityError, ConfigError, UnsupportedOperationError
from ..kernels.quant_format import QuantFormat
from ..memory import MemoryReport, tensor_bytes
from ..paging.group import identical_rows
from .base import KVStorage, Region, part_of, prefixed
from .dense import DenseStorage
from .reads import DenseRead, Gather, Read, placeholders
from .value_range import RangeGuard, code_limit

#: Full-precision recent tokens kept by default (KIVI's residual length).
DEFAULT_WINDOW = 128


class QuantizedSegment(ABC):
    """The quantized tokens of one layer, oldest first, written in whole groups and never re-quantized.

    `length` counts tokens held; token 0 is the oldest one not dropped. Appends are whole groups;
    `drop_front` may cut into a group (its bytes stay until the whole group is gone).
    """

    fmt: QuantFormat
    length: int = 0
    batch_size: int = 0
    #: Dtype of the K/V given to `append` (what `dequantized` returns by default).
    dtype: torch.dtype = torch.float32
    #: Tokens dropped from the front of the oldest unit still held (units start at -front_offset).
    front_offset: int = 0

    #: Whether rows with the same tokens share storage (a paged segment's blocks): `append` then uses `same_rows`.
    shares_rows: bool = False
    #: Whether its tensors at rest are shared beyond this layer (a paged pool's blocks): `KVStorage.shared_at_rest`.
    shared_at_rest: bool = False
    #: Whether its scales are float32 (optimum-quanto's), which no value overflows: nothing is range-checked.
    float32_scales: bool = False

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor, same_rows: list[int] | None = None) -> None:
        """Quantizes `[batch, kv_heads, n, head_dim]` K/V, `n` a multiple of the group size, after the held tokens.

        `same_rows[row]`: the first row whose appended tokens equal this row's (beams of one prompt), when the
        caller knows it; a segment that `shares_rows` shares their storage on its first fill."""

    def shard_heads(self, local: int) -> None:  # noqa: B027 - an optional hook
        """Learns a tensor-parallel rank's share of KV heads before the first append (`KVStorage.shard_heads`)."""

    def begin_update(self) -> None:  # noqa: B027 - an optional hook
        """Called as each forward reaches this layer, before it appends: every layer has attended the last one,
        so a segment may free what earlier forwards dropped (a paged segment's group trims)."""

    @abstractmethod
    def dequantized(self, first: int, last: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `first .. last - 1` dequantized to dense `[batch, kv_heads, last - first, head_dim]` K/V."""

    @abstractmethod
    def drop_front(self, count: int) -> None:
        """Forgets the `count` oldest tokens. Lazily: until the next append, a `read` taken before still reads
        them, and `dequantized` reads them at negative positions (the layers of a step attend after their
        retention dropped tokens)."""

    @abstractmethod
    def truncate(self, keep: int) -> None:
        """Keeps the oldest `keep` tokens; `keep` ends on a group boundary of the appended groups."""

    @property
    def unit(self) -> int:
        """Tokens per append: whole groups (a paged segment appends whole blocks)."""
        return self.fmt.group_size

    def flush_tokens(self, window: int) -> int:
        """Tokens a full-precision window of `window` tokens hands over at a time: a multiple of `unit`."""
        return self.unit

    def group_start(self, token: int) -> int:
        """The first token of the appended unit holding `token` (units stay aligned to appends)."""
        return token - (token + self.front_offset) % self.unit

    @abstractmethod
    def read(self, first: int, count: int, recent_k: torch.Tensor, recent_v: torch.Tensor, dense: Gather) -> Read:
        """What a decode query reads (`storage.reads`): held tokens `first .. first + count - 1` (count > 0), then
        the full-precision `recent_k`/`recent_v`; `dense` gathers the same tokens."""

    @abstractmethod
    def index_batch(self, indices: torch.Tensor) -> None: ...

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def memory(self) -> MemoryReport:
        """Bytes at rest: codes as payload, scales and zero points as metadata, headroom as reserved."""

    def quantized_part(self) -> tuple[MemoryReport, int]:
        """What `quantized_report` counts: the bytes of the coded tokens (codes as payload, scales and zeros as
        metadata) and the tokens per row of the report's `batch_size`."""
        return self.memory(), self.length

    def tensors(self) -> dict[str, torch.Tensor]:
        """The code and parameter tensors, by name (what an offloading placement moves; see `KVStorage`)."""
        raise UnsupportedOperationError(f"{type(self).__name__} cannot be moved off the device (it has no tensors())")

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        raise UnsupportedOperationError(f"{type(self).__name__} cannot be moved off the device (no load_tensors())")

    def take_written(self) -> dict[str, Region]:
        """Regions written in place since the last call, by tensor name (see `KVStorage.take_written`)."""
        return {}


class QuantizedStorage(KVStorage):
    """Old tokens in a `QuantizedSegment`, the newest `window` (or more, up to a group) at full precision, and with
    `first`, the first tokens of each row at full precision too (attention sinks).

    New tokens land in a full-precision `DenseStorage`; once it holds `window + group_size` tokens or
    more, its oldest whole groups are quantized into the segment (once: a group is never re-quantized),
    so at least `window` recent tokens are always exact. Decode attends over the segment in place
    (the segment's `read`: codes for the fused dequantizing kernel) plus the window; prefill attends with SDPA
    over the dequantized past and, at full precision, what the window held for each of its queries: the newest
    `window + new - 1` tokens, the fresh chunk and the past's window (what this forward pushed out of the window
    is quantized at once, and attended as it was). A one-token step's window is the `window` newest, as before.

    The first `first` tokens stay at the front of the full-precision buffer, before the window, and are never
    quantized (the `head`): in token order the head, the segment, the window; a decode kernel reads the codes and
    then the buffer as one residual, which attention does not mind (RoPE is in the keys), with the model's mask
    reordered to match. Dropping the oldest tokens drops the head first.

    Rolling back into the quantized tokens (`drop_back`, assisted decoding with a small window) moves the
    kept part of the cut group back into the window dequantized; it is quantized again later.

    With `sinks` (in place of a head), copies of the `sinks` coded tokens of each row with the shortest values (the
    longest over heads) are kept beside the codes at 16 bits (the model's dtype where it has 16 bits, else float16):
    the tokens attention piles onto (inside a sliding window; in a full-attention layer, the first tokens and the
    full stops and newlines after them), whose coding error its output takes whole. They are chosen as tokens leave
    the window and replaced as shorter ones leave it after them; their codes stay in the segment (in token order, for
    dropping from the front), masked in a decode kernel's read, where the copies come first in the residual, and
    overwritten by the copies in a dense one. A copy whose token the segment
    dropped or rolled back is masked until a leaving token takes its place.
    """

    reads_in_place = True

    def __init__(self, segment: QuantizedSegment, window: int = DEFAULT_WINDOW, first: int = 0, sinks: int = 0):
        group = segment.fmt.group_size
        if isinstance(window, bool) or not isinstance(window, int) or window < group:
            raise ConfigError(
                f"the full-precision window ({window!r} tokens) must be an int of at least one group "
                f"({group} tokens): keys are quantized a whole group of tokens at a time"
            )
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"the full-precision first tokens must be an int >= 0, got {first!r}")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ConfigError(f"the sinks kept beside the codes must be an int >= 0, got {sinks!r}")
        if sinks and first:
            raise ConfigError(f"sinks kept beside the codes ({sinks}) take the place of the exact first tokens "
                              f"(first={first}): give one or the other")  # fmt: skip
        self.segment = segment
        self.sinks = sinks
        #: The sinks' copies, `[batch, kv_heads, held, dim]` keys and values (held <= `sinks`), and each one's token:
        #: `[batch, held]` segment index (token 0: the oldest held), `_GONE` once its token was dropped or rolled back.
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.sink_index: torch.Tensor | None = None
        self.window = window
        self.first = first
        self.head = 0  # first tokens held at full precision, in front of `recent`'s window
        self.recent = DenseStorage()
        # The full-precision K/V of tokens a multi-token forward moved from the window into the segment, which its
        # queries still attend exact (`read`); None after a one-token step, whose window `recent` always holds.
        self._left: tuple[torch.Tensor, torch.Tensor] | None = None
        self._flushed = 0  # tokens ever quantized into the segment
        # For a segment that shares rows: which rows of the first forward (the prompt) are equal, and its length.
        self._prompt: tuple[list[int], int] | None = None
        # What leaves the window is coded only if the format can hold it (`value_range`); else as 0, and counted.
        self.range_guard = RangeGuard(*code_limit(segment.fmt, segment.float32_scales))

    @property
    def shared_at_rest(self) -> bool:
        return self.segment.shared_at_rest

    def shard_heads(self, local: int) -> None:
        self.segment.shard_heads(local)

    def formats(self) -> tuple:
        return (self.fmt,)

    def states(self) -> tuple:
        return (getattr(self.segment, "state", None),)

    @property
    def fmt(self) -> QuantFormat:
        return self.segment.fmt

    @property
    def length(self) -> int:
        return self.segment.length + self.recent.length

    @property
    def batch_size(self) -> int:
        return self.recent.batch_size or self.segment.batch_size

    #: The head dim `fmt.check_head_dim` passed, and the segment's `flush_tokens(window)`: fixed once the first append
    #: has seen them (a decode step's calls are its host cost; None until then, and in a storage saved before).
    _checked_dim: int | None = None
    _flush_unit: int | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        segment, recent = self.segment, self.recent
        if keys.shape[-1] != self._checked_dim:
            segment.fmt.check_head_dim(keys.shape[-1])
            self._checked_dim = keys.shape[-1]
        new = keys.shape[2]
        if keys.shape[0] > 1 and segment.shares_rows and self.length == 0:
            # Read once, at the prompt, so that a decode step that first fills the segment need not compare rows.
            self._prompt = (identical_rows(keys), keys.shape[2])
        segment.begin_update()
        head = self.head
        recent.append(keys, values)
        if head < self.first and self.length == head + new:  # nothing held after the head yet: it takes the first
            self.head = min(self.first, head + new)
        self._left = None
        unit = self._flush_unit
        if unit is None:
            unit = self._flush_unit = segment.flush_tokens(self.window)
        h = self.head
        held = recent.length
        flush = (held - h - self.window) // unit * unit
        if flush > 0:
            old_k, old_v = recent.view(held)
            old_k, old_v = old_k[:, :, h : h + flush], old_v[:, :, h : h + flush]
            left = min(flush, self.window + new - 1 - (self.recent.length - h - flush))
            if new > 1 and left > 0:  # slices of the buffer; copied where the head moves over them
                self._left = (old_k[:, :, flush - left :], old_v[:, :, flush - left :])
                if h:
                    self._left = (self._left[0].clone(), self._left[1].clone())
            in_prompt = self._prompt is not None and h + self._flushed + flush <= self._prompt[1]
            try:
                guard = self.range_guard
                self.segment.append(guard(old_k), guard(old_v), self._prompt[0] if in_prompt else None)
            except CapacityError:  # no block for the group the new tokens filled: the storage stays as it was
                self.recent.drop_back(new)
                self.head, self._left = head, None
                raise
            if self.sinks:
                self._take_sinks(old_k, old_v)
            self._flushed += flush
            self.recent.drop_after(h, flush)
            if self._prompt is not None and h + self._flushed >= self._prompt[1]:
                self._prompt = None  # the whole prompt is quantized: nothing left to share

    def _parts(self, last: int) -> tuple[int, int, int, int]:
        """How many of the `last` newest tokens are in the head, the segment and the window (token order), and the
        segment's length."""
        n = self.segment.length
        window = min(last, self.recent.length - self.head)
        coded = min(last - window, n)
        return last - window - coded, coded, window, n

    def view(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        head, coded, window, n = self._parts(last)
        if coded == 0:  # in token order in the buffer
            return self.recent.view(head + window)
        k, v = self.recent.view(window)
        hk, hv = self._head_view(head)
        old_k, old_v = self.segment.dequantized(n - coded, n, k.dtype)
        if self.sink_index is not None:
            old_k, old_v = _with_sinks(old_k, old_v, self.sink_index - (n - coded), self.sink_k, self.sink_v)
        return torch.cat([hk, old_k, k], dim=2), torch.cat([hv, old_v, v], dim=2)

    def _head_view(self, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest `head` tokens of the head (views of the buffer's front)."""
        k, v = self.recent.view(self.recent.length)
        return k[:, :, self.head - head : self.head], v[:, :, self.head - head : self.head]

    def read(self, last: int, new: int) -> Read:
        """The segment's codes in place, then the buffer (head and window) as one residual (a segment's dropped tokens
        stay readable until its next append); `dense()` gathers the same tokens in token order, those the forward
        pushed out of the window exact."""
        left, self._left = self._left, None
        head, coded, window, n = self._parts(last)
        if coded == 0:  # only full-precision tokens in view, in token order in the buffer
            return DenseRead(*self.recent.view(head + window))
        rk, rv = self.recent.view(head + window)
        if self.sink_index is not None:
            return self._read_with_sinks(coded, window, n, rk, rv, left)
        read = self.segment.read(n - coded, coded, rk, rv, partial(self._gather, coded, rk, rv, head, left))
        if head == 0 or type(read) is DenseRead:  # (a segment without a kernel gathers in token order)
            return read
        return read._replace(mask=partial(_head_after_codes, head, coded))

    def _read_with_sinks(self, coded: int, window: int, n: int, rk, rv, left) -> Read:
        """`read` with the sinks' copies: in the residual before the window (a decode kernel's read, the copies' codes
        masked), over their codes (`dense()`); where they stand taken now, as drops the read outlives move them."""
        at, sk, sv = self.sink_index - (n - coded), self.sink_k, self.sink_v
        gather = partial(self._gather, coded, rk, rv, 0, left, (at, sk, sv))
        residual_k, residual_v = torch.cat([sk.to(rk.dtype), rk], dim=2), torch.cat([sv.to(rv.dtype), rv], dim=2)
        read = self.segment.read(n - coded, coded, residual_k, residual_v, gather)
        if type(read) is DenseRead:
            return read
        keys, values = placeholders(rk, rk.shape[0], rk.shape[1], coded + window, rk.shape[3], rv.shape[3])
        return read._replace(keys=keys, values=values, mask=partial(_sinks_after_codes, at, coded, window))

    def _gather(self, coded: int, rk, rv, head: int, left, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The read's tokens densely, in token order: `head` tokens of the residual `rk`/`rv`, the newest `coded`
        coded tokens dequantized (the last ones that this forward pushed out of the window, `left`, as they were),
        the rest of the residual."""
        n = self.segment.length
        k, v = self.segment.dequantized(n - coded, n, rk.dtype)
        if sinks is not None:  # (before `left`: a copy of a token this forward pushed out gives way to the token)
            k, v = _with_sinks(k, v, *sinks)
        if left is not None:
            m = min(left[0].shape[2], coded)
            k[:, :, coded - m :] = left[0][:, :, -m:]
            v[:, :, coded - m :] = left[1][:, :, -m:]
        return (
            torch.cat([rk[:, :, :head], k, rk[:, :, head:]], dim=2),
            torch.cat([rv[:, :, :head], v, rv[:, :, head:]], dim=2),
        )

    def _take_sinks(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """After `keys`/`values` left the window for the segment: copies of the `sinks` shortest values among those
        held and these."""
        flush, n = keys.shape[2], self.segment.length
        fresh = torch.arange(n - flush, n, device=keys.device).expand(keys.shape[0], flush)
        dtype = keys.dtype if keys.element_size() == 2 else torch.float16
        if self.sink_index is None:
            index, k, v = fresh, keys, values
        else:
            index = torch.cat([self.sink_index, fresh], dim=1)
            k = torch.cat([self.sink_k.to(keys.dtype), keys], dim=2)
            v = torch.cat([self.sink_v.to(values.dtype), values], dim=2)
        lengths = v.float().norm(dim=-1).amax(dim=1).masked_fill(index < 0, float("inf"))  # [batch, held + flush]
        chosen = lengths.topk(min(self.sinks, index.shape[1]), dim=1, largest=False).indices
        pick = chosen[:, None, :, None]
        self.sink_k = k.gather(2, pick.expand(-1, k.shape[1], -1, k.shape[3])).to(dtype)
        self.sink_v = v.gather(2, pick.expand(-1, v.shape[1], -1, v.shape[3])).to(dtype)
        self.sink_index = index.gather(1, chosen)

    def drop_front(self, count: int) -> None:
        from_head = min(count, self.head)
        if from_head:
            self.recent.drop_front(from_head)
            self.head -= from_head
        count -= from_head
        from_segment = min(count, self.segment.length)
        if from_segment:
            self.segment.drop_front(from_segment)
            if self.sink_index is not None:  # (a new tensor: a read taken before keeps the indices it was taken with)
                self.sink_index = self.sink_index - from_segment
        if count > from_segment:
            self.sink_k = self.sink_v = self.sink_index = None  # every coded token is gone: their copies go too
            self.recent.drop_front(count - from_segment)

    def drop_back(self, count: int) -> None:
        self._prompt = None  # the tokens that follow are no longer the prompt's
        from_window = min(count, self.recent.length - self.head)
        if from_window:
            self.recent.drop_back(from_window)
        rest = count - from_window
        if not rest:
            return
        from_head = max(0, rest - self.segment.length)  # rolled back through every coded token into the head
        keep = self.segment.length - (rest - from_head)
        cut = max(self.segment.group_start(keep), 0) if keep else 0
        if cut < keep:  # the kept head of a cut group returns to the window (after the head), dequantized
            k, v = self.segment.dequantized(cut, keep, self._dtype())
            self.segment.truncate(cut)
            self.recent.append(k.contiguous(), v.contiguous())
        else:
            self.segment.truncate(keep)
        if self.sink_index is not None:  # copies of rolled-back tokens: gone (their indices come back for other tokens)
            self.sink_index = self.sink_index.masked_fill(self.sink_index >= self.segment.length, _GONE)
        if from_head:
            self.recent.drop_back(from_head)
            self.head -= from_head

    def index_batch(self, indices: torch.Tensor) -> None:
        self.segment.index_batch(indices)
        self.recent.index_batch(indices)
        if self.sink_index is not None:
            rows = indices.to(self.sink_index.device)
            self.sink_k, self.sink_v, self.sink_index = self.sink_k[rows], self.sink_v[rows], self.sink_index[rows]
        if self._prompt is not None:
            prompt_of = [self._prompt[0][i] for i in indices.tolist()]  # rows of one prompt share its first row
            self._prompt = ([prompt_of.index(p) for p in prompt_of], self._prompt[1])

    def reset(self) -> None:
        self.segment.reset()
        self.recent.reset()
        self.range_guard.take()  # (what it counted goes with the tokens)
        self.head = 0
        self.sink_k = self.sink_v = self.sink_index = None
        self._left = None
        self._flushed, self._prompt = 0, None

    def memory(self) -> MemoryReport:
        report = self.segment.memory() + self.recent.memory()
        if self.sink_index is None:
            return report
        return replace(report, payload_bytes=report.payload_bytes + tensor_bytes([self.sink_k, self.sink_v]),
                       metadata_bytes=report.metadata_bytes + tensor_bytes([self.sink_index]))  # (bytes, no tokens)

    def quantized_part(self) -> tuple[MemoryReport, int]:
        """Bytes of the quantized tokens (codes as payload, scales and zeros as metadata) and their count per row
        (`QuantizedSegment.quantized_part`)."""
        return self.segment.quantized_part()

    def sinks_part(self) -> tuple[int, int]:
        return self.held_sinks, 0 if self.sink_k is None else self.sink_k.element_size()

    @property
    def held_sinks(self) -> int:
        """Sinks' copies per row held now."""
        return 0 if self.sink_index is None else self.sink_index.shape[1]

    def exact_part(self) -> tuple[int, int]:
        """Tokens per row held at full precision outside the window (the head), and bytes per element there."""
        return self.head, 0 if self.recent.keys is None else self.recent.keys.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        return prefixed("segment", self.segment.tensors()) | prefixed("recent", self.recent.tensors())

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.segment.load_tensors(part_of("segment", tensors))
        self.recent.load_tensors(part_of("recent", tensors))

    def take_written(self) -> dict[str, Region]:
        return prefixed("segment", self.segment.take_written()) | prefixed("recent", self.recent.take_written())

    def _dtype(self) -> torch.dtype:
        return self.recent.keys.dtype if self.recent.keys is not None else self.segment.dtype


#: A sink copy's index once its token is gone (dropped from the front, or rolled back): below any index held.
_GONE = -(1 << 40)


def _with_sinks(k, v, at: torch.Tensor, sink_k, sink_v) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized coded tokens `k`/`v` with the sinks' copies over their codes; `at`: `[batch, sinks]` index of each
    among them (out of view: left out)."""
    count = k.shape[2]
    if count == 0:
        return k, v
    at = at.masked_fill((at < 0) | (at >= count), count)  # (out of view: into a spare token, cut off)
    pick = at[:, None, :, None]
    k = torch.cat([k, k[:, :, :1]], dim=2).scatter_(2, pick.expand(-1, k.shape[1], -1, k.shape[3]),
                                                     sink_k.to(k.dtype))  # fmt: skip
    v = torch.cat([v, v[:, :, :1]], dim=2).scatter_(2, pick.expand(-1, v.shape[1], -1, v.shape[3]),
                                                     sink_v.to(v.dtype))  # fmt: skip
    return k[:, :, :count], v[:, :, :count]


def _sinks_after_codes(at: torch.Tensor, coded: int, window: int, mask: torch.Tensor | None) -> torch.Tensor:
    """The model's `[batch, coded + window]` decode mask (token order; None: every token) in a read's layout: codes
    (each sink's masked), the sinks' copies (`at`: `[batch, sinks]` index of each among the codes; out of view,
    masked), the window."""
    batch = at.shape[0]
    if mask is None:
        mask = torch.ones(batch, coded + window, dtype=torch.bool, device=at.device)
    seen = (at >= 0) & (at < coded)
    at = at.masked_fill(~seen, coded)  # (out of view: a spare column, cut off)
    codes = torch.cat([mask[:, :coded], mask.new_zeros(batch, 1)], dim=1)
    copies = codes.gather(1, at)
    codes = codes.scatter(1, at, False)
    return torch.cat([codes[:, :coded], copies, mask[:, coded:]], dim=1)


def _head_after_codes(head: int, coded: int, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The model's `[batch, head + coded + window]` decode mask (token order) in a read's layout: codes, head, window."""
    if mask is None:
        return None
    return torch.cat([mask[:, head : head + coded], mask[:, :head], mask[:, head + coded :]], dim=1)
