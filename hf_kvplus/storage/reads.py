"""What attention reads from a storage, described passively: `attention.route` picks the kernel.

A storage's `read(last, new)` describes the `last` tokens that `new` fresh queries attend to, at the
moment `update` returns (the retention may drop tokens right after; a read still names them). A dense
storage's read is its keys and values. Paged and quantized storages are read in place by a decode
kernel, so their reads name the pools or codes, and hand attention shape-correct NaN placeholders as
keys and values (never read on the kernel path, loud if some other attention function computes with
them); `dense()` gathers the tokens for a call that cannot take the kernel. Slots (evicting layers) are
read in no sequence order, masked by what each slot holds: as dense tensors, or quantized slots as their codes
(keys per token) with placeholders, as a quantized storage's read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..kernels.constants import Constants
from ..kernels.quant_format import PackedKV, QuantFormat

#: A dense copy of the tokens a read describes: `[batch, kv_heads, last, head_dim]` keys and values.
Gather = Callable[[], tuple[torch.Tensor, torch.Tensor]]


class DenseRead(NamedTuple):
    """Keys and values as dense `[batch, kv_heads, last, head_dim]` tensors."""

    keys: torch.Tensor
    values: torch.Tensor


class PagedRead(NamedTuple):
    """Tokens `start .. start + length - 1` of the rows' block tables, in full-precision block pools."""

    keys: torch.Tensor  # placeholder
    values: torch.Tensor  # placeholder
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    block_table: torch.Tensor
    start: int
    length: int
    dense: Gather


class PackedRead(NamedTuple):
    """Quantized tokens `start .. start + length - 1` of `packed` (through `block_table` when paged), then
    the full-precision `recent_k`/`recent_v`."""

    keys: torch.Tensor  # placeholder
    values: torch.Tensor  # placeholder
    packed: PackedKV
    fmt: QuantFormat
    start: int
    length: int
    recent_k: torch.Tensor
    recent_v: torch.Tensor
    block_table: torch.Tensor | None
    dense: Gather
    #: The storage's own decode mask `[batch, length + recent]` from the model's `[batch, kv]` one (or None), for a
    #: layout the model's mask does not line up with (a static storage's ring); None: the model's mask as it is.
    mask: Callable[[torch.Tensor | None], torch.Tensor] | None = None
    #: The layer's state of `fmt` (`KVFormat.make_state`: a rotated format's key centre), or None.
    state: object = None


class SlotRead(NamedTuple):
    """Per-head slots of a `SlotStore` as `[batch, kv_heads, slots, head_dim]` keys and values, in no sequence
    order (the fresh tokens in the last slots, or a refilled hole); `valid()` gives the `[batch, slots]` mask of
    slots holding real tokens (None: all do), known once attention has seen the model's mask.

    Quantized slots come as their codes (`packed`, keys per token, in `fmt`) with placeholders as keys and values,
    and `dense()` dequantizes them for a call that cannot take the decode kernel. A first-tokens region comes as the
    exact `residual_k`/`residual_v` `[batch, kv_heads, first, dim]` the decode kernel reads after the codes, with
    `decode_mask()` its `[batch, slots + first]` mask (the region's slots masked in the codes)."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: Callable[[], torch.Tensor | None]
    packed: PackedKV | None = None
    fmt: QuantFormat | None = None
    dense: Gather | None = None
    residual_k: torch.Tensor | None = None
    residual_v: torch.Tensor | None = None
    decode_mask: Callable[[], torch.Tensor] | None = None
    #: The layer's state of `fmt` (a rotated format's key centre), or None.
    state: object = None


Read = DenseRead | PagedRead | PackedRead | SlotRead


def placeholders(
    like: torch.Tensor, batch: int, kv_heads: int, last: int, key_dim: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape-correct NaN keys and values of `like`'s dtype and device, with no memory of their own."""
    nan = _NAN.get((like.dtype, like.device), lambda: torch.full((), float("nan"), dtype=like.dtype, device=like.device))
    return nan.expand(batch, kv_heads, last, key_dim), nan.expand(batch, kv_heads, last, value_dim)


_NAN: Constants[torch.Tensor] = Constants()  # one scalar per dtype and device


def quantized_read(
    packed: PackedKV,
    fmt: QuantFormat,
    start: int,
    length: int,
    recent_k: torch.Tensor,
    recent_v: torch.Tensor,
    block_table: torch.Tensor | None,
    dense: Gather,
    state=None,
) -> PackedRead:
    """A `PackedRead`, its placeholders shaped for the `length` quantized tokens plus the recent ones (`state`: the
    layer's state of `fmt`)."""
    batch, heads, recent, key_dim = recent_k.shape
    keys, values = placeholders(recent_k, batch, heads, length + recent, key_dim, recent_v.shape[-1])
    return PackedRead(keys, values, packed, fmt, start, length, recent_k, recent_v, block_table, dense, state=state)
