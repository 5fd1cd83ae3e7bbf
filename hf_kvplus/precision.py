"""Precision regions: which tokens and layers a quantized cache keeps at full precision (or at other bits), one
description for every quantized storage.

- `window`: the newest tokens of each row (each query's window: see `QuantizedStorage`);
- `first`: the first tokens of each row (attention sinks: most attention mass falls there), in full-attention layers;
- `boundary`: the first and last `boundary` layers at full precision, or at `boundary_bits`.

Bits per coordinate (`QuantizedCache.quantized_report`) count every token outside the window, these regions included.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .storage.quantized import DEFAULT_WINDOW


@dataclass(frozen=True)
class PrecisionRegions:
    window: int = DEFAULT_WINDOW
    first: int = 0
    boundary: int = 0
    #: The boundary layers' bits (a format `resolve_format` takes); None: full precision.
    boundary_bits: int | str | None = None

    def __post_init__(self):
        for name in ("first", "boundary"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if self.boundary_bits is not None and not self.boundary:
            raise ConfigError(f"boundary_bits={self.boundary_bits!r} needs boundary layers (boundary >= 1)")

    def is_boundary(self, index: int, num_layers: int) -> bool:
        """Whether layer `index` of `num_layers` is one of the first or last `boundary`."""
        return index < self.boundary or index >= num_layers - self.boundary
