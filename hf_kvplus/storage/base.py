"""Storage: how one layer's key/value bytes are held (dense or paged; which number format)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..errors import CacheMismatchError, UnsupportedOperationError
from ..memory import MemoryReport
from .reads import DenseRead, Read
from .value_range import RangeGuard

#: A region written in place: `(dim, lo, hi)`, the slice `lo:hi` along dimension `dim`.
Region = tuple[int, int, int]


class KVStorage(ABC):
    """The bytes of one layer's K/V for every batch row, in sequence order.

    A storage only holds tokens; which tokens stay is the retention's choice, where the bytes live is
    the placement's, and which kernel reads them is `attention.route`'s. A storage is passive: it hands
    out dense views (`view`) and describes what attention reads (`read`: its dense tensors, or the
    pools or codes a decode kernel reads in place).
    """

    #: Tokens held per batch row.
    length: int = 0
    #: Batch rows held (0 before the first append).
    batch_size: int = 0
    #: Tokens every read spans, when fixed (a buffer of that many positions that the model's mask cuts down):
    #: the layer's mask sizes and a compiled decode's shapes then never change. None: reads span what is held.
    static_length: int | None = None
    #: The model's mask width when fixed by something other than `static_length` (a compileable evicting store's slots,
    #: free ones included): the layer then places the fresh tokens' columns at the count of tokens seen. None: the
    #: mask spans what is held and the fresh tokens, which end it.
    mask_width: int | None = None
    #: Whether the storage counts the tokens its layer has seen on the device too (`count`, a `TokenCount`), so that
    #: a compiled step reads and writes no Python int: static storages and the slots of a compileable cache.
    device_count: bool = False
    count = None
    #: Whether `read` hands attention what only hf_kvplus's attention reads (blocks, codes, unordered slots), so a
    #: model whose code computes on the cached K/V itself cannot use it (`ModelSpec.dense_only`).
    reads_in_place: bool = False
    #: What a decode step gives that its codes cannot hold, coded as 0 and counted on the device (a
    #: `value_range.RangeGuard`; reported at the next prompt or `quantized_report()`). None: nothing is coded.
    range_guard: RangeGuard | None = None
    #: Whether its tensors at rest are shared beyond this layer (a paged pool's blocks): an offloading placement then
    #: moves the regions written (`take_written`) and checks what it fetched is still current, never the whole.
    shared_at_rest: bool = False

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes `[batch, kv_heads, new, head_dim]` keys and values after the tokens already held."""

    @abstractmethod
    def view(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `last` tokens held, as `[batch, kv_heads, last, head_dim]` keys and values."""

    def read(self, last: int, new: int) -> Read:
        """What `new` fresh queries attend to, the `last` newest tokens held (`storage.reads`); by default
        the dense `view(last)`. Called as `update` returns, before the retention drops anything."""
        return DenseRead(*self.view(last))

    @property
    def held(self) -> int:
        """Tokens held per batch row (`length`, less any slot freed but not yet reused)."""
        return self.length

    def formats(self) -> tuple:
        """The quantized formats its codes are in (none at full precision): the layer has each `prepare` its
        tables at its first call."""
        return ()

    def states(self) -> tuple:
        """The layer's state of each of :meth:`formats`, in order (`KVFormat.make_state`: a rotated format's key
        centre; None for a format without), which reports count and a saved cache holds."""
        return tuple(None for _ in self.formats())

    def quantized_part(self) -> tuple[MemoryReport, int] | None:
        """Bytes of the coded tokens held (codes as payload, scales and zeros as metadata) and their count per row,
        what `quantized_report()` sums; None for a storage that codes nothing (a full-precision layer, whose every
        token past the window counts at its dtype's bits)."""
        return None

    def exact_part(self) -> tuple[int, int]:
        """Of a storage that codes (`quantized_part`): tokens per row it holds at full precision outside the window
        (the exact first tokens), and bytes per element there; (0, 0) by default."""
        return 0, 0

    def sinks_part(self) -> tuple[int, int]:
        """Of a storage that codes: copies per row of coded tokens it keeps beside their codes (a sliding layer's
        sinks: bits of tokens already counted as coded), and bytes per element there; (0, 0) by default."""
        return 0, 0

    def shard_heads(self, local: int) -> None:  # noqa: B027 - an optional hook
        """Learns, before the first append, that this rank holds `local` KV heads of the layer (tensor parallel):
        only storages sized ahead of their first append (a block pool's layer) need to hear it."""

    def note_mask(self, attention_mask: torch.Tensor, new: int) -> None:  # noqa: B027 - an optional hook
        """Sees the model's 4-d mask of a forward of `new` tokens, before attention (which of them are padding)."""

    def note_no_mask(self) -> None:  # noqa: B027 - an optional hook
        """Hears that a forward came without a mask (none of its tokens is padding). Told only by storages that count
        on the device (`device_count`): a compileable one learns this at the prompt, eagerly, what it would otherwise
        learn at the first masked step, which may be compiled."""

    @abstractmethod
    def drop_front(self, count: int) -> None:
        """Forgets the `count` oldest tokens."""

    @abstractmethod
    def drop_back(self, count: int) -> None:
        """Forgets the `count` newest tokens."""

    def shrink_to_fit(self) -> None:
        """Gives back the headroom beyond what the held tokens' growth step needs (a pass that grew the buffers and
        then dropped what it appended, as KVzip's repeat through a sliding window does). Storages whose buffers
        do not grow ahead of their tokens have none to give back."""
        return None

    @abstractmethod
    def index_batch(self, indices: torch.Tensor) -> None:
        """Keeps batch rows `indices` (in that order, repeats allowed): beam reorder, selection, fan-out."""

    @abstractmethod
    def reset(self) -> None:
        """Frees everything held."""

    @abstractmethod
    def memory(self) -> MemoryReport:
        """Bytes held at rest (tokens fields are filled in by the layer)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor holding this storage's bytes, by name: what an offloading placement moves."""
        raise UnsupportedOperationError(f"{type(self).__name__} cannot be moved off the device (it has no tensors())")

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Holds `tensors` (the `tensors()` of this storage, in another memory) in place of its own."""
        raise UnsupportedOperationError(f"{type(self).__name__} cannot be moved off the device (no load_tensors())")

    def take_written(self) -> dict[str, Region]:
        """The regions written in place since the last call, by tensor name.

        An offloading placement writes back only these; a changed tensor that is not named here is
        written back whole, so a storage may name nothing and stay correct.
        """
        return {}


def widened(written: tuple[int, int] | None, lo: int, hi: int) -> tuple[int, int]:
    """The token range `written` grown to cover `lo:hi` (what a storage reports from `take_written`)."""
    return (lo, hi) if written is None else (min(lo, written[0]), max(hi, written[1]))


def prefixed(prefix: str, tensors: dict) -> dict:
    """`tensors` (or regions) with names `prefix.name`: a storage made of parts names its parts' tensors so."""
    return {f"{prefix}.{name}": t for name, t in tensors.items()}


def part_of(prefix: str, tensors: dict) -> dict:
    """The entries of `tensors` named `prefix.name`, by `name`."""
    cut = len(prefix) + 1
    return {name[cut:]: t for name, t in tensors.items() if name.startswith(prefix + ".")}


def check_fits(
    keys: torch.Tensor, values: torch.Tensor, layout: tuple[int, int, int, int], dtype: torch.dtype, device
) -> None:
    """Refuses new keys/values that do not fit a storage holding `layout` = (batch, kv_heads, key head_dim, value
    head_dim) K/V of `dtype` on `device`: the shapes and the place are fixed by the first append."""
    batch, heads, key_dim, value_dim = layout
    if (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]) != layout:
        raise CacheMismatchError(
            f"new keys/values of shape {tuple(keys.shape)}/{tuple(values.shape)} do not fit the cache's "
            f"[batch={batch}, kv_heads={heads}, head_dim={key_dim}, value head_dim={value_dim}] layout"
        )
    if keys.dtype != dtype or keys.device != device:
        raise CacheMismatchError(f"new keys are {keys.dtype} on {keys.device}, the cache holds {dtype} on {device}")
