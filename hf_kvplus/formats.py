"""The one quantized-format resolver: what `bits` and `group_size` mean for a model, for every quantized storage
(the dense and paged quantized caches, the evicting caches' slots, offloaded quantized layers)."""

from __future__ import annotations

import math

from .errors import ConfigError
from .kernels.quant_format import BIT_WIDTHS, QuantFormat
from .model_spec import ModelSpec

#: Default group size per format: the largest that keeps int8 under 0.56, int4 under 0.32 and int2 under
#: 0.19 of float16's bytes per token (codes plus float16 scales and zero points).
DEFAULT_GROUP = {8: 64, 4: 32, 2: 32, "fp8": 32}


def parse_bits(bits) -> int | str:
    """8, 4, 2 or "fp8"; also accepts "int8"/"int4"/"int2" and "8"/"4"/"2"."""
    given = bits
    if isinstance(bits, str):
        text = bits.strip().lower().removeprefix("int")
        bits = int(text) if text.isdigit() else text
    if isinstance(bits, bool) or bits not in BIT_WIDTHS:
        raise ConfigError(f"bits must be 8, 4, 2 or 'fp8' (int8/int4/int2/fp8), got {given!r}")
    return bits


def resolve_format(spec: ModelSpec, bits: int | str | None, group_size: int | None) -> QuantFormat | None:
    """The `QuantFormat` of `bits`/`group_size` for every layer of a model (None when `bits` is None), checked
    against every head_dim; the default group is `DEFAULT_GROUP`'s, reduced to divide every head_dim."""
    if bits is None:
        if group_size is not None:
            raise ConfigError(f"group_size={group_size!r} needs bits (8, 4, 2 or 'fp8'): full precision has no groups")
        return None
    bits = parse_bits(bits)
    head_dims = sorted({layer.head_dim for layer in spec.layers if layer.holds_kv})
    if group_size is None:
        group_size = math.gcd(DEFAULT_GROUP[bits], *head_dims)
    fmt = QuantFormat(bits, group_size)
    for head_dim in head_dims:
        fmt.check_head_dim(head_dim)
    return fmt
