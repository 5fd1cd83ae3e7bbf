"""Bytes of each KV-cache storage format and of each weight dtype.

Layouts, per layer, per batch row, per KV head, for a head of `D = head_dim` channels:

- ``fp32`` / ``fp16`` / ``bf16``: keys and values as they are, ``2 x D x (4 | 2 | 2)`` bytes per token.
- ``fp8`` (e4m3, the quantized-cache issue's format): one byte per value, plus one fp16 scale per
  (token, KV head) for the keys and one for the values: ``2 x (D + 2)`` bytes per token.
- ``int8`` / ``int4`` / ``int2`` (KIVI-style asymmetric group quantization, ``b`` bits, group size
  ``G``, default 64): values are packed ``ceil(D x b / 8)`` bytes per token row.
  Keys are quantized per channel along tokens: each group of ``G`` consecutive quantized tokens has,
  for every one of the ``D`` channels, an fp16 scale and an fp16 zero point (``4 x D`` bytes per
  group, ``4 x D / G`` per token; a partial last group is counted as a whole one). Values are
  quantized per token along channels: each token's ``D`` channels form ``D / G`` groups with an fp16
  scale and zero point each (``4 x D / G`` bytes per token; ``G`` must divide ``D``). The most recent
  ``residual`` tokens (default 128) are held in fp16 (``2 x D x 2`` bytes per token) and quantized
  once they leave that window.

Bytes per token over fp16, scales and zero points included, the fp16 window excluded, are therefore
``b / 16 + 2 / G``, whatever ``D``: at ``G = 64`` int8 0.53125, int4 0.28125, int2 0.15625; fp8 is
``(D + 2) / (2 D)``, 0.5078 at ``D = 128``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

#: Bytes of one scale or zero point (fp16).
SCALE_BYTES = 2
#: Bytes of one value in the full-precision recent window of the integer formats (fp16).
RESIDUAL_VALUE_BYTES = 2
#: Default group size of the integer formats (tokens per key group, channels per value group).
DEFAULT_GROUP_SIZE = 64
#: Default number of most recent tokens the integer formats hold in fp16.
DEFAULT_RESIDUAL = 128


@dataclass(frozen=True)
class KVFormat:
    """How one KV head's keys and values are stored: `kind` is "float", "fp8" or "int"."""

    name: str
    bits: int
    kind: str

    @property
    def is_grouped(self) -> bool:
        """Integer formats: group scales and zero points, and a full-precision recent window."""
        return self.kind == "int"

    def row_bytes(self, head_dim: int) -> int:
        """Payload bytes of one token's keys (or values) for one KV head, packed."""
        return math.ceil(head_dim * self.bits / 8)

    def stored_bytes(self, tokens: int, head_dim: int, group_size: int) -> int:
        """Keys + values bytes of `tokens` tokens of one KV head in this format (no fp16 window)."""
        payload = 2 * tokens * self.row_bytes(head_dim)
        if self.kind == "float":
            return payload
        if self.kind == "fp8":
            return payload + 2 * tokens * SCALE_BYTES
        key_groups = math.ceil(tokens / group_size)
        key_scales = key_groups * head_dim * 2 * SCALE_BYTES
        value_scales = tokens * (head_dim // group_size) * 2 * SCALE_BYTES
        return payload + key_scales + value_scales

    def bytes_per_token(self, head_dim: int, group_size: int) -> int:
        """Keys + values bytes one stored token costs one KV head, scales included, fp16 window excluded."""
        if self.kind == "int":
            return 2 * self.row_bytes(head_dim) + 2 * (head_dim // group_size) * 2 * SCALE_BYTES
        return self.stored_bytes(1, head_dim, group_size)


def residual_bytes(tokens: int, head_dim: int) -> int:
    """Keys + values bytes of `tokens` tokens of one KV head held in the fp16 recent window."""
    return 2 * tokens * head_dim * RESIDUAL_VALUE_BYTES


KV_FORMATS: dict[str, KVFormat] = {
    "fp32": KVFormat("fp32", 32, "float"),
    "fp16": KVFormat("fp16", 16, "float"),
    "bf16": KVFormat("bf16", 16, "float"),
    "fp8": KVFormat("fp8", 8, "fp8"),
    "int8": KVFormat("int8", 8, "int"),
    "int4": KVFormat("int4", 4, "int"),
    "int2": KVFormat("int2", 2, "int"),
}

#: Bits per weight. Nominal: the scales of quantized weights are not counted.
WEIGHT_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}

_ALIASES = {
    "float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
}


def _canonical(name: str) -> str:
    key = str(name).strip().lower()
    return _ALIASES.get(key, key)


def kv_format(name: str | KVFormat) -> KVFormat:
    """The KV format called `name` (fp32, fp16, bf16, fp8, int8, int4, int2)."""
    if isinstance(name, KVFormat):
        return name
    found = KV_FORMATS.get(_canonical(name))
    if found is None:
        raise ConfigError(f"unknown KV cache format {name!r}; known formats: {', '.join(KV_FORMATS)}")
    return found


def weight_bits(dtype: str) -> int:
    """Bits per weight of `dtype` (fp32, fp16, bf16, fp8, int8, int4)."""
    bits = WEIGHT_BITS.get(_canonical(dtype))
    if bits is None:
        raise ConfigError(f"unknown weights dtype {dtype!r}; known: {', '.join(WEIGHT_BITS)}")
    return bits


def check_group_size(fmt: KVFormat, group_size: int, head_dims: set[int]) -> None:
    """Integer formats need a positive group size dividing every head_dim (values group channels)."""
    if not fmt.is_grouped:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive integer for {fmt.name}, got {group_size!r}")
    for head_dim in sorted(head_dims):
        if head_dim % group_size:
            divisors = [g for g in range(1, head_dim + 1) if head_dim % g == 0 and g >= 8]
            raise ConfigError(
                f"group_size {group_size} does not divide head_dim {head_dim}: {fmt.name} values are grouped "
                f"along the {head_dim} channels of each token; group sizes that divide it: {divisors}"
            )
