"""Precision regions: which tokens and layers a quantized cache keeps at full precision (or at other bits), one
description for every quantized storage.

- `window`: the newest tokens of each row (each query's window: see `QuantizedStorage`);
- `first`: the first tokens of each row (attention sinks: most attention mass falls there), in full-attention layers;
- `boundary`: the first and last `boundary` layers at full precision, or at `boundary_bits`;
- `layer_bits`: any layer's own format (`{index: bits}`, None: full precision), e.g. what `kvplus calibrate` chose.

Bits per coordinate (`QuantizedCache.quantized_report`) count every token outside the window, these regions included.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError
from .storage.quantized import DEFAULT_WINDOW
from .storage.value_range import raise_pending


@dataclass(frozen=True)
class PrecisionRegions:
    window: int = DEFAULT_WINDOW
    first: int = 0
    boundary: int = 0
    #: The boundary layers' bits (a format `resolve_format` takes); None: full precision.
    boundary_bits: int | str | None = None
    #: Layers with a format of their own, as sorted `(index, bits)` pairs (given as a mapping; bits None: full
    #: precision); an entry wins over `boundary`.
    layer_bits: tuple[tuple[int, int | str | None], ...] = ()

    def __post_init__(self):
        for name in ("first", "boundary"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if self.boundary_bits is not None and not self.boundary:
            raise ConfigError(f"boundary_bits={self.boundary_bits!r} needs boundary layers (boundary >= 1)")
        pairs = self.layer_bits.items() if isinstance(self.layer_bits, Mapping) else self.layer_bits
        pairs = tuple(sorted((index, bits) for index, bits in pairs))
        for index, _ in pairs:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ConfigError(f"layer_bits keys must be layer indices (ints >= 0), got {index!r}")
        object.__setattr__(self, "layer_bits", pairs)

    def is_boundary(self, index: int, num_layers: int) -> bool:
        """Whether layer `index` of `num_layers` is one of the first or last `boundary`."""
        return index < self.boundary or index >= num_layers - self.boundary

    def check_layers(self, num_layers: int) -> None:
        """Refuses `layer_bits` entries past the model's layers."""
        beyond = [index for index, _ in self.layer_bits if index >= num_layers]
        if beyond:
            raise ConfigError(f"layer_bits names layers {beyond}, but the model has {num_layers} (0..{num_layers - 1})")

    def own_bits(self, num_layers: int) -> dict[int, int | str | None]:
        """The layers whose format is not the cache's, with their bits (None: full precision): the boundary layers at
        `boundary_bits`, then `layer_bits`'s entries."""
        own = {index: self.boundary_bits for index in range(num_layers) if self.is_boundary(index, num_layers)}
        return own | dict(self.layer_bits)

    def bits_of(self, index: int, num_layers: int, bits: int | str | None) -> int | str | None:
        """The bits layer `index` holds: its own (`own_bits`), else the cache's `bits`."""
        return self.own_bits(num_layers).get(index, bits)

    def overrides(self) -> bool:
        """Whether some layer may hold a format other than the cache's."""
        return bool(self.boundary or self.layer_bits)


def precision_report(cache, format_name: str, window: int) -> dict:
    """`quantized_report` of a cache (a `KVCache`) whose layers hold a `QuantizedStorage` (contiguous or paged),
    `StaticQuantizedStorage`, `SlotStore` (through their `quantized_part` and `exact_part`) or, at full precision, a
    `DenseStorage` or `PagedStorage` (a boundary or sliding layer: every token past the `window` counts at its dtype's
    bits). First raises what a decode step gave that the codes cannot hold (`storage.value_range`)."""
    raise_pending(cache.layers)
    quantized_bytes = tokens = fp16_bytes = 0
    region_bits = region_coordinates = 0
    for layer in cache.layers:
        storage = getattr(layer, "storage", None)
        if storage is None:
            continue
        bits, coordinates = layer_region_bits(layer, window)
        region_bits += bits
        region_coordinates += coordinates
        if not hasattr(storage, "quantized_part"):
            continue
        report, length = storage.quantized_part()
        quantized_bytes += report.payload_bytes + report.metadata_bytes
        held = length * report.batch_size
        tokens = max(tokens, held)
        fp16_bytes += held * 2 * 2 * layer.spec.num_kv_heads * layer.spec.head_dim
    return {
        "format": format_name,
        "quantized_tokens": tokens,
        "quantized_bytes": quantized_bytes,
        "bytes_per_token": quantized_bytes / tokens if tokens else 0.0,
        "ratio_to_fp16": quantized_bytes / fp16_bytes if fp16_bytes else 0.0,
        "bits_per_coordinate": region_bits / region_coordinates if region_coordinates else 0.0,
    }


def layer_region_bits(layer, window: int) -> tuple[int, int]:
    """One layer's share of `bits_per_coordinate`: the bits it holds outside the `window` (codes, scales and zeros,
    exact regions at their dtype's bits) and the coordinates they hold; (0, 0) for a layer without a storage."""
    storage = getattr(layer, "storage", None)
    if storage is None:
        return 0, 0
    coordinates = 2 * layer.spec.num_kv_heads * layer.spec.head_dim  # of one token of one row
    if not hasattr(storage, "quantized_part"):  # a full-precision layer: every token past the window counts
        outside = max(0, storage.length - window) * storage.batch_size
        held = next(iter(storage.tensors().values()), None)  # (a buffer or a block pool)
        bits = 0 if held is None else held.element_size() * 8
        return outside * coordinates * bits, outside * coordinates
    report, length = storage.quantized_part()
    exact, element_size = storage.exact_part()
    exact *= storage.batch_size
    held = length * report.batch_size
    coded = report.payload_bytes + report.metadata_bytes
    return coded * 8 + exact * coordinates * element_size * 8, (held + exact) * coordinates
