"""The quantized block tensors of one layer: codes and float16 group scales, `[blocks, kv_heads, block_size, ...]`."""

from __future__ import annotations

import torch

from ..errors import CacheMismatchError, ConfigError
from ..kernels.dispatch import quantize_keys, quantize_values
from ..kernels.quant_attention import gather_blocks
from ..kernels.quant_format import PACKED_NAMES, PackedKV, QuantFormat, dequantize_keys, dequantize_values
from .block_pool import BlockPool
from .layer_pool import BlockTensors


def check_block_size(block_size: int, fmt: QuantFormat) -> None:
    """A quantized block holds whole key groups: `block_size` must be a multiple of the group size."""
    if block_size % fmt.group_size:
        raise ConfigError(
            f"block_size {block_size} is not a multiple of group_size {fmt.group_size} ({fmt}): a quantized block "
            f"holds whole key groups; give a block_size that is a multiple of {fmt.group_size} or a group_size "
            f"that divides {block_size}"
        )


class QuantLayerPool(BlockTensors):
    """One layer's quantized blocks in the `kernels.quant_format` paged layout, sized to its `BlockPool`.

    Block `b` of the pool holds `block_size` tokens: codes `k[b]`/`v[b]` (uint8 `[kv_heads, block_size,
    head_dim // per]`), key scales and zero points `k_scale[b]`/`k_zero[b]` (float16 `[kv_heads, block_size //
    group_size, head_dim]`, one row per group of tokens) and value scales and zero points `v_scale[b]`/`v_zero[b]`
    (float16 `[kv_heads, block_size, head_dim // group_size]`). `packed` hands them to the decode kernel.

    Allocated at the first write (the device comes from the model), grown with the `BlockPool`, like `LayerPool`.
    A block is only ever written whole (`write`): a paged segment quantizes a block once it is full. `state`: the
    layer's state of the format (`KVFormat.make_state`: a rotated format's key centre), held here so that the pool's
    caches and its prefix store share it.
    """

    def __init__(
        self, blocks: BlockPool, block_size: int, num_kv_heads: int, head_dim: int, fmt: QuantFormat, state=None
    ):
        check_block_size(block_size, fmt)
        fmt.check_head_dim(head_dim)
        self.blocks = blocks
        self.block_size, self.num_kv_heads, self.head_dim, self.fmt = block_size, num_kv_heads, head_dim, fmt
        self.state = state
        self.k = self.k_scale = self.k_zero = self.v = self.v_scale = self.v_zero = None
        blocks.add_grow_listener(self._grow)

    @staticmethod
    def bytes_per_block(fmt: QuantFormat, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one block of K and V (codes, scales, zero points) of a layer, before any allocation."""
        return round(num_kv_heads * block_size * fmt.bytes_per_token(head_dim))

    # ------------------------------------------------------------------ state
    @property
    def packed(self) -> PackedKV:
        """The pool tensors as the quantized decode kernel reads them (with a `block_table`)."""
        return PackedKV(*(getattr(self, name) for name in PACKED_NAMES))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K and V in this layer, codes and parameters (0 before the first write)."""
        return self.code_bytes + self.param_bytes

    @property
    def code_bytes(self) -> int:
        """Bytes of the codes of one block (0 before the first write)."""
        return sum(_block_bytes(getattr(self, name)) for name in ("k", "v"))

    @property
    def param_bytes(self) -> int:
        """Bytes of the float16 scales and zero points of one block (0 before the first write)."""
        return sum(_block_bytes(getattr(self, name)) for name in PACKED_NAMES if name not in ("k", "v"))

    # -------------------------------------------------------------- writing
    def ensure(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocates the tensors on the device of `keys`, or checks that it is the one held."""
        if keys.shape[1] != self.num_kv_heads or keys.shape[-1] != self.head_dim:
            raise CacheMismatchError(
                f"new keys of shape {tuple(keys.shape)} do not fit the pool's {self.num_kv_heads} KV heads of "
                f"head_dim {self.head_dim}"
            )
        if self.k is None:
            self.fmt.check_head_dim(values.shape[-1])
            with self.blocks.hold():  # two threads' first writes allocate once
                if self.k is None:
                    self._allocate(self.blocks.capacity, keys.device, values.shape[-1])
        elif keys.device != self.k.device:
            raise CacheMismatchError(f"new keys are on {keys.device}, the pool holds blocks on {self.k.device}")
        elif values.shape[-1] != (held := self.fmt.channels(self.v.shape[-1], "values")):
            raise CacheMismatchError(f"new values have head_dim {values.shape[-1]}, the pool holds {held}")

    def write(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantizes whole blocks `[n, kv_heads, block_size, head_dim]` of K/V into blocks `ids` (int64 `[n]`)."""
        quantized = (*quantize_keys(keys, self.fmt, check=False, state=self.state),
                     *quantize_values(values, self.fmt, check=False))  # fmt: skip
        for name, new in zip(PACKED_NAMES, quantized, strict=True):
            target = getattr(self, name)
            if target is not None:
                target.index_copy_(0, ids, new)

    def dequantized(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `ids` (int64 `[batch, columns]`) dequantized to `[batch, kv_heads, columns * block_size, dim]`."""
        k, k_scale, k_zero, v, v_scale, v_zero = (
            None if t is None else gather_blocks(t, ids) for t in (getattr(self, name) for name in PACKED_NAMES)
        )
        return (
            dequantize_keys(k, k_scale, k_zero, self.fmt, dtype, state=self.state),
            dequantize_values(v, v_scale, v_zero, self.fmt, dtype),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The code and parameter block tensors by name: what an offloading placement moves."""
        return {} if self.k is None else self.packed.tensors()

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in PACKED_NAMES:
            setattr(self, name, tensors.get(name))

    # ---------------------------------------------------------- internals
    def _allocate(self, capacity: int, device: torch.device, v_dim: int) -> None:
        codes = PackedKV.allocate(
            self.fmt, capacity, self.num_kv_heads, self.block_size, self.head_dim, v_dim, device, torch.zeros
        )
        self.load_tensors(codes.tensors())

    def _grow(self, capacity: int) -> None:
        if self.k is None:
            return
        for name in PACKED_NAMES:
            old = getattr(self, name)
            if old is not None:
                new = old.new_zeros(capacity, *old.shape[1:])
                new[: old.shape[0]] = old
                setattr(self, name, new)


def _block_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t[0].numel() * t.element_size()


