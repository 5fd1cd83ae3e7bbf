"""Bytes of each KV-cache storage format and of each weight dtype.

The quantized formats are exactly what :class:`hf_kvplus.quantized_cache.QuantizedCache` holds: the
byte layouts are :class:`hf_kvplus.kernels.quant_format.QuantFormat` (KIVI) and
:class:`hf_kvplus.kernels.rotated_format.RotatedFormat` (rotated), imported here, not restated, and the
default group sizes are the cache's ``DEFAULT_GROUP``.

Layouts, per layer, per batch row, per KV head, for a head of `D = head_dim` channels:

- ``fp32`` / ``fp16`` / ``bf16``: keys and values as they are, ``2 x D x (4 | 2 | 2)`` bytes per token.
- ``int8`` / ``int4`` / ``int2`` / ``fp8``: KIVI grouping with group size ``G`` for all four. Codes are
  packed ``D x b / 8`` bytes per token row for keys and for values (``b`` = 8, 4, 2; fp8 is e4m3,
  one byte per value). Keys are quantized per channel along tokens: each group of ``G`` consecutive
  quantized tokens has, for every one of the ``D`` channels, an fp16 scale and (int only) an fp16
  zero point (``4 x D / G`` bytes per token for int, ``2 x D / G`` for fp8; a partial last group is
  counted as a whole one). Values are quantized per token along channels: each token's ``D``
  channels form ``D / G`` groups with an fp16 scale (and, int only, zero point) each (``4 x D / G``
  bytes per token for int, ``2 x D / G`` for fp8; ``G`` must divide ``D``).
- Default ``G`` (``group_size=None``): the cache's, ``gcd(DEFAULT_GROUP[format], *head_dims)`` with
  ``DEFAULT_GROUP`` int8 64, int4 32, int2 32, fp8 32. An explicit group size applies to every
  grouped format (int8/int4/int2/fp8) and must divide every head_dim.
- ``k<X>v<Y>`` (rotated, the TurboQuant class; any ``X``, ``Y`` in 1, 2, 3, 4, 8, such as ``k4v4``,
  ``k4v2``, ``k3v2``, ``k2v2``): each token's key and value of a head are rotated and coded ``X`` (keys)
  and ``Y`` (values) bits per channel, packed ``D x X / 8`` and ``D x Y / 8`` bytes, plus one fp16 norm
  each: ``D x (X + Y) / 8 + 4`` bytes per token, ``RotatedFormat.bytes_per_token``. No groups and no
  scales: like fp16, a rotated format ignores ``group_size`` (the resolved group size is None).
  ``D`` must be a multiple of 8 (codes fill whole bytes).
- A format registered by name (``kernels.kv_format.register_format``, such as ``examples/formats/fp4_e2m1.py``'s
  ``fp4``): its bytes are the registered format object's own (:meth:`KVFormat.layout`), as for the built-in ones:
  codes ``code_dim`` per token and side, float16 scales (and zero points where ``has_zero``) of ``param_shape``,
  key groups of the format's ``group_size`` tokens counted whole. Its maker gets `group_size` (None: its default)
  and the model's head dims, as the cache's resolver gives them.
- The most recent ``residual`` tokens (default 128, the cache's ``window``) of every quantized format
  (KIVI and rotated) are held at full precision, counted as fp16 (``2 x D x 2`` bytes per token; the
  cache holds them in the model's dtype, so a float32 model holds twice that), and quantized once they
  leave that window. For the KIVI formats the cache keeps between ``window`` and ``window + G - 1``
  recent tokens (it quantizes whole groups); the planner counts exactly ``min(held, residual)``, so at
  most ``G - 1`` tokens per layer that the cache still holds at full precision are counted at the
  quantized rate. A rotated format codes every token on its own, but its window hands tokens over 32 at a
  time (``kernels.rotated_format.FLUSH_TOKENS``; a window under 32 tokens, as many as it holds): the cache
  holds between ``window`` and ``window + 31``, counted the same way.

Bytes per token over fp16, scales and zero points included, the fp16 window excluded, are therefore
``b / 16 + 2 / G`` for int and ``1 / 2 + 1 / G`` for fp8, whatever ``D``: at the default groups
int8 0.53125 (``G = 64``), int4 0.3125, int2 0.1875, fp8 0.53125 (``G = 32``); and
``(X + Y) / 32 + 1 / D`` for ``kXvY``: at ``D = 128`` k4v4 0.2578125, k4v2 0.1953125, k3v2 0.1640625,
k2v2 0.1328125.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..formats import DEFAULT_GROUP
from ..kernels import kv_format as kernel_formats
from ..kernels.quant_format import QuantFormat
from ..kernels.rotated_format import ROTATED_BITS, RotatedFormat
from ..storage.quantized import DEFAULT_WINDOW

#: Bytes of one scale or zero point (fp16).
SCALE_BYTES = 2
#: Bytes of one value in the full-precision recent window of the quantized formats (counted as fp16).
RESIDUAL_VALUE_BYTES = 2
#: Default group size of each quantized format before the gcd with the head dims (tokens per key group,
#: channels per value group): `QuantizedCache`'s ``DEFAULT_GROUP``, keyed by format name.
DEFAULT_GROUP_SIZE: dict[str, int] = {
    "int8": DEFAULT_GROUP[8],
    "int4": DEFAULT_GROUP[4],
    "int2": DEFAULT_GROUP[2],
    "fp8": DEFAULT_GROUP["fp8"],
}
#: Default number of most recent tokens the quantized formats hold at full precision (the cache's window).
DEFAULT_RESIDUAL = DEFAULT_WINDOW
#: A rotated format's name: "k<key bits>v<value bits>" (the bits checked against `ROTATED_BITS`).
_ROTATED_NAME = re.compile(r"k(\d+)v(\d+)")


@dataclass(frozen=True)
class KVFormat:
    """How one KV head's keys and values are stored: `kind` is "float", "fp8", "int", "rotated" or "registered" (a
    format registered by name: `bits` 0, its bytes are its format object's).

    `bits` is the bits per key code, and per value code unless `value_bits` is given (a rotated format's
    values, ``KVFormat("k4v2", 4, "rotated", value_bits=2)``); `value_bits` is filled in from `bits` otherwise.
    The bytes of every quantized kind are read off the format object the cache codes with (:meth:`layout`, the
    `kernels.kv_format.KVFormat` protocol), not restated here.
    """

    name: str
    bits: int
    kind: str
    value_bits: int | None = None

    def __post_init__(self):
        if self.value_bits is None:
            object.__setattr__(self, "value_bits", self.bits)

    @property
    def key_bits(self) -> int:
        return self.bits

    @property
    def is_grouped(self) -> bool:
        """The KIVI formats (int8/int4/int2/fp8): group scales, so a group size."""
        return self.kind in ("int", "fp8")

    @property
    def is_rotated(self) -> bool:
        """The rotated formats (kXvY): codes and one fp16 norm per vector, no groups."""
        return self.kind == "rotated"

    @property
    def is_registered(self) -> bool:
        """A format registered by name (`kernels.kv_format.register_format`): its maker makes the layout."""
        return self.kind == "registered"

    @property
    def is_quantized(self) -> bool:
        """The formats `QuantizedCache` stores (KIVI, rotated, registered): a full-precision recent window."""
        return self.is_grouped or self.is_rotated or self.is_registered

    @property
    def cache_bits(self) -> int | str | None:
        """The `bits` argument of `QuantizedCache` for this format (8, 4, 2, "fp8", "k4v2", a registered name);
        None if unquantized."""
        if self.kind == "fp8":
            return "fp8"
        if self.is_rotated or self.is_registered:
            return self.name
        return self.bits if self.kind == "int" else None

    def layout(self, group_size: int | None, head_dims) -> kernel_formats.KVFormat:
        """The format object the cache codes with (what its bytes are read off): `QuantFormat` at `group_size`,
        `RotatedFormat`, or the registered maker's, given `group_size` and the model's `head_dims`."""
        if self.is_grouped:
            return self.quant_format(group_size)
        if self.is_rotated:
            return self.rotated_format()
        if self.is_registered:
            make = kernel_formats.registered_format(self.name)
            if make is None:
                raise ConfigError(f"format {self.name!r} is no longer registered")
            made = make(group_size, tuple(sorted(head_dims)))
            if not isinstance(made, kernel_formats.KVFormat):
                raise ConfigError(f"format {self.name!r}: its maker returned {type(made).__name__}, not a KVFormat")
            return made
        raise ConfigError(f"{self.name} is not a quantized format: it has no coded layout")

    def quant_format(self, group_size: int) -> QuantFormat:
        """The cache's byte layout of this KIVI format at `group_size`."""
        if not self.is_grouped:
            raise ConfigError(f"{self.name} is not a grouped format: it has no group layout")
        return QuantFormat(self.cache_bits, group_size)

    def rotated_format(self) -> RotatedFormat:
        """The cache's byte layout of this rotated format (the rotation seed changes no byte)."""
        if not self.is_rotated:
            raise ConfigError(f"{self.name} is not a rotated format")
        return RotatedFormat(self.key_bits, self.value_bits)

    def default_group_size(self, head_dims) -> int | None:
        """The group size `QuantizedCache` picks when given none: gcd(DEFAULT_GROUP, every head_dim)."""
        if not self.is_grouped:
            return None
        return math.gcd(DEFAULT_GROUP[self.cache_bits], *head_dims)

    def row_bytes(self, head_dim: int) -> int:
        """Payload bytes of one token's keys (or values) for one KV head, packed (keys' for a rotated format)."""
        return math.ceil(head_dim * self.bits / 8)

    def stored_bytes(self, tokens: int, head_dim: int, group_size: int | None, head_dims=None) -> int:
        """Keys + values bytes of `tokens` tokens of one KV head in this format (no fp16 window).

        Quantized formats, read off :meth:`layout` (`head_dims`: the model's, for a registered maker; default
        ``(head_dim,)``): codes (``code_dim`` of each side per token), plus the float16 scales (and zero points
        where ``has_zero``) of ``param_shape``: keys in ``ceil(tokens / group_size)`` whole groups (KIVI: ``G``
        tokens, so ``ceil(tokens / G) x D`` scales; rotated: one norm a token), values per token (KIVI: ``D / G``
        channel groups; rotated: one norm).
        """
        if not self.is_quantized:
            return 2 * tokens * self.row_bytes(head_dim)
        fmt = self.layout(group_size, (head_dim,) if head_dims is None else head_dims)
        codes = tokens * (fmt.code_dim(head_dim, "keys") + fmt.code_dim(head_dim, "values"))
        grouped = math.ceil(tokens / fmt.group_size) * fmt.group_size  # a partial last group counted whole
        scales = math.prod(fmt.param_shape("keys", grouped, head_dim)) + math.prod(
            fmt.param_shape("values", tokens, head_dim)
        )
        return codes + scales * SCALE_BYTES * (2 if fmt.has_zero else 1)

    def bytes_per_token(self, head_dim: int, group_size: int | None, head_dims=None) -> int | float:
        """Keys + values bytes one stored token costs one KV head, scales included, fp16 window excluded: the
        format object's `bytes_per_token` for a quantized format (:meth:`layout`; an integer when it is one, such
        as a KIVI format whose ``G`` divides ``D``)."""
        if not self.is_quantized:
            return self.stored_bytes(1, head_dim, group_size)
        exact = self.layout(group_size, (head_dim,) if head_dims is None else head_dims).bytes_per_token(head_dim)
        return int(exact) if exact == int(exact) else exact


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
    # Rotated formats: `kv_format` takes any "k<X>v<Y>" (X, Y in ROTATED_BITS); these are the common ones.
    "k4v4": KVFormat("k4v4", 4, "rotated", value_bits=4),
    "k4v2": KVFormat("k4v2", 4, "rotated", value_bits=2),
    "k3v2": KVFormat("k3v2", 3, "rotated", value_bits=2),
    "k2v2": KVFormat("k2v2", 2, "rotated", value_bits=2),
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
    """The KV format called `name`: fp32, fp16, bf16, fp8, int8, int4, int2, or a rotated "k<X>v<Y>" with X-bit
    keys and Y-bit values, X and Y each in 1, 2, 3, 4, 8 (any pair, not only those in `KV_FORMATS`)."""
    if isinstance(name, KVFormat):
        return name
    key = _canonical(name)
    if kernel_formats.registered_format(key) is not None:  # as the cache's resolver: a registered name first
        return KVFormat(key, 0, "registered")
    found = KV_FORMATS.get(key)
    if found is not None:
        return found
    rotated = _ROTATED_NAME.fullmatch(key)
    if rotated is not None:
        key_bits, value_bits = (int(b) for b in rotated.groups())
        try:
            RotatedFormat(key_bits, value_bits)
        except ConfigError as error:
            raise ConfigError(f"KV cache format {name!r}: {error}") from error
        return KVFormat(key, key_bits, "rotated", value_bits=value_bits)
    bits = "/".join(str(b) for b in ROTATED_BITS)
    registered = kernel_formats.registered_formats()
    raise ConfigError(
        f"unknown KV cache format {name!r}; known formats: {', '.join(KV_FORMATS)}, or any rotated "
        f"k<key bits>v<value bits> with bits in {bits}"
        + (f", or a registered format ({', '.join(registered)})" if registered else "")
    )


def weight_bits(dtype: str) -> int:
    """Bits per weight of `dtype` (fp32, fp16, bf16, fp8, int8, int4)."""
    bits = WEIGHT_BITS.get(_canonical(dtype))
    if bits is None:
        raise ConfigError(f"unknown weights dtype {dtype!r}; known: {', '.join(WEIGHT_BITS)}")
    return bits


def resolve_group_size(fmt: KVFormat, group_size: int | None, head_dims: set[int]) -> int | None:
    """The group size a `QuantizedCache` in `fmt` would use: `group_size`, or the cache's default for the
    format when None (see `KVFormat.default_group_size`); checked against every head_dim. None for the
    formats without groups (unquantized and rotated), whatever `group_size` is; a rotated format's head dims
    are checked (multiples of 8). A registered format: `group_size` as given (its maker's default for None), the
    head dims checked by the format it makes (`check_head_dim`)."""
    if fmt.is_rotated:
        check_rotated_head_dims(fmt, head_dims)
    if fmt.is_registered:
        layout = fmt.layout(group_size, head_dims)
        for head_dim in sorted(head_dims):
            layout.check_head_dim(head_dim)
        return group_size
    if not fmt.is_grouped:
        return None
    if group_size is None:
        group_size = fmt.default_group_size(sorted(head_dims))
    check_group_size(fmt, group_size, head_dims)
    return group_size


def check_group_size(fmt: KVFormat, group_size: int, head_dims: set[int]) -> None:
    """Quantized formats need a positive group size dividing every head_dim (values group channels), and
    head dims that pack into whole bytes."""
    if not fmt.is_grouped:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive integer for {fmt.name}, got {group_size!r}")
    per_byte = fmt.quant_format(group_size).per_byte
    for head_dim in sorted(head_dims):
        if head_dim % group_size:
            divisors = [g for g in range(1, head_dim + 1) if head_dim % g == 0 and g >= 8]
            raise ConfigError(
                f"group_size {group_size} does not divide head_dim {head_dim}: {fmt.name} values are grouped "
                f"along the {head_dim} channels of each token; group sizes that divide it: {divisors}"
            )
        if head_dim % per_byte:
            raise ConfigError(
                f"head_dim {head_dim} is not a multiple of {per_byte}: {fmt.name} packs {per_byte} codes per byte"
            )


def check_rotated_head_dims(fmt: KVFormat, head_dims: set[int]) -> None:
    """A rotated format packs 8 codes into whole bytes: every head_dim must be a multiple of 8
    (`RotatedFormat.check_head_dim`, the cache's own check)."""
    layout = fmt.rotated_format()
    for head_dim in sorted(head_dims):
        try:
            layout.check_head_dim(head_dim)
        except ConfigError as error:
            raise ConfigError(f"{fmt.name}: {error}") from error
