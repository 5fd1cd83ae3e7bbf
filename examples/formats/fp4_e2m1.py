"""fp4 (e2m1) KV codes, written from outside hf_kvplus as a user would: one KVFormat subclass, registered by importing
this file, after which ``QuantizedCache(config, bits="fp4")`` and the spec string ``quantized:fp4`` use it.

Layout (KIVI's grouping, no zero point): keys per channel in groups of `group_size` tokens, values per token in groups
of `group_size` channels; one float16 scale per group, ``s >= amax / 6`` (rounded up to float16, so no code
clips); each element is coded as the nearest e2m1 value of ``x / s`` (sign and 3 magnitude bits: 0, 0.5, 1, 1.5, 2,
3, 4, 6; a tie goes to the smaller magnitude), two codes a byte (channel 2i in the low nibble, 2i + 1 in the high).

Error bound, per element: ``|x - x^| <= max(s / 4, |x| / 4)`` (half the grid's gap at ``|x| / s``: 0.25 up to 2, then
0.5 up to 4, then 1 up to 6). At rest: ``D + 4 D / group_size`` bytes per token of one head (keys and values). On
SmolLM2-135M (2048 tokens of Pride and Prejudice, chunks of 32, `perplexity_fp4.py`): perplexity 17.717 where full
precision gives 17.588 (+0.7%; int4 17.584, int2 19.948).

Decode attention runs hf_kvplus's plain-torch twin on every device (dequantize a chunk, then attend), eager and
compiled: no kernel of its own is registered.
"""

from __future__ import annotations

import math

import torch

from hf_kvplus.kernels.errors import ConfigError, ShapeError
from hf_kvplus.kernels.kv_format import KVFormat, register_format

#: The e2m1 magnitudes, by 3-bit code.
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Midpoints between neighbouring magnitudes: a magnitude's code is how many of them lie strictly below it.
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(MAGNITUDES[:-1], MAGNITUDES[1:], strict=True))
#: Default tokens per key group (and channels per value group), reduced to divide every head dim.
DEFAULT_GROUP = 32


class FP4Format(KVFormat):
    """fp4 e2m1 codes with a float16 scale per group (see the module doc)."""

    def __init__(self, group_size: int = DEFAULT_GROUP):
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ConfigError(f"fp4: group_size must be a positive int, got {group_size!r}")
        self.group_size = group_size

    def __eq__(self, other) -> bool:
        return isinstance(other, FP4Format) and other.group_size == self.group_size

    def __hash__(self) -> int:
        return hash(("fp4", self.group_size))

    def __str__(self) -> str:
        return f"fp4/g{self.group_size}"

    def code_dim(self, head_dim: int, side: str) -> int:
        return head_dim // 2

    def channels(self, code_bytes: int, side: str) -> int:
        return code_bytes * 2

    def param_shape(self, side: str, tokens: int, head_dim: int) -> tuple[int, int]:
        if side == "keys":
            return tokens // self.group_size, head_dim
        return tokens, head_dim // self.group_size

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 2 or head_dim % self.group_size:
            raise ConfigError(f"fp4/g{self.group_size}: head_dim {head_dim} must be even and a multiple of the group "
                              f"size {self.group_size}")  # fmt: skip

    def bytes_per_token(self, head_dim: int) -> float:
        return 2 * self.code_dim(head_dim, "keys") + 2 * 2 * head_dim / self.group_size

    def code_limit(self) -> tuple[float, bool]:
        return 65504.0 * 6, False  # the largest float16 scale times the largest magnitude

    def quantize(self, x, side, positions=None):
        T, D = x.shape[-2:]
        self.check_head_dim(D)
        if side == "keys" and T % self.group_size:
            raise ShapeError(f"fp4: keys hold {T} tokens, not a multiple of the group size {self.group_size}")
        axis = -2 if side == "keys" else -1  # the axis a group runs along: tokens for keys, channels for values
        xf = x.float().unflatten(axis, (-1, self.group_size))
        scale = _scale(xf.abs().amax(dim=axis))
        codes = _encode(xf / scale.float().unsqueeze(axis))
        return _pack(codes.flatten(axis - 1, axis)), scale, None

    def dequantize(self, codes, scale, zero, side, dtype=torch.float32, *, positions=None):
        axis = -2 if side == "keys" else -1
        y = _unpack(codes).unflatten(axis, (-1, self.group_size))
        return (y * scale.float().unsqueeze(axis)).flatten(axis - 1, axis).to(dtype)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """float16 scales at least amax / 6 (rounded up, never 0), so no code clips."""
    return (amax / 6 * (1 + 2.0**-10) + 2.0**-25).clamp_min(2.0**-24).to(torch.float16)


def _encode(y: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit codes of ``y`` (|y| <= 6): sign in bit 3, the magnitude's index in bits 0-2."""
    magnitude = (y.abs().unsqueeze(-1) > y.new_tensor(_MIDPOINTS)).sum(-1)
    return (magnitude + 8 * (y < 0)).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """float32 values in units of the scale: a 16-entry table read per nibble."""
    table = torch.tensor([*MAGNITUDES, *(-m for m in MAGNITUDES)], dtype=torch.float32, device=packed.device)
    nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
    return table[nibbles.long()]


def make(group_size: int | None, head_dims: tuple[int, ...]) -> FP4Format:
    """The registry's maker: the given group, or the default reduced to divide every head dim."""
    return FP4Format(math.gcd(DEFAULT_GROUP, *head_dims) if group_size is None else group_size)


register_format("fp4", make)
