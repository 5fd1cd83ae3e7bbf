"""OffloadedCache: K/V at rest in host memory (and optionally on disk), brought to the device a layer ahead."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from transformers import PreTrainedConfig

from .cache import KVCache
from .errors import ConfigError
from .fitted import key_scale_for
from .formats import is_rotated
from .placement.offloaded import Offloaded
from .precision import PrecisionRegions
from .quantized_cache import asked_full_sinks, preset_first_tokens, quantized_storage
from .storage.dense import DenseStorage
from .storage.quantized import DEFAULT_WINDOW


class OffloadedCache(KVCache):
    """Every layer's K/V rest in host memory and come to the accelerator `lookahead` layers ahead of use.

    Lossless with the default full-precision storage (token-identical to `DynamicCache`); with `bits`
    (8, 4, 2, "fp8" or a rotated "k4v2" with its `rotation_seed`, as `QuantizedCache`) the packed codes rest on the host and cross the bus, a
    quarter of the bytes at int4. `host_budget` (bytes) and `folder` add a disk tier: layers beyond the
    budget go to memory-mapped files in `folder`, read back ahead of use and removed with the cache.
    `key_scale` ("auto"): a rotated format's keys scaled as `QuantizedCache`'s are (the model's fitted scale, where
    one ships; "off" or None: none). `layer_bits` and `layer_rotations`: layers with a format or a rotation seed of their
    own, as `QuantizedCache`'s.
    Works without CUDA (the host is then the compute device: only the disk tier moves bytes).
    `tier_bytes()` tells where the bytes are. Other caches take the same placement:
    `QuantizedCache(config, placement=Offloaded())`, `PagedCache(config, placement=Offloaded())`,
    `SinkCache(config, placement=Offloaded())`...

    >>> cache = OffloadedCache(model.config)                                   # host memory, 1 layer ahead
    >>> cache = OffloadedCache(model.config, bits=4, host_budget=8 << 30, folder="/scratch/kv")
    >>> model.generate(**inputs, cache=cache)
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        lookahead: int = 1,
        host_budget: int | None = None,
        folder: str | Path | None = None,
        bits: int | str | None = None,
        group_size: int | None = None,
        window: int = DEFAULT_WINDOW,
        first_tokens: int | None = None,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
        rotation_seed: int = 0,
        key_scale="auto",
        layer_rotations: Mapping[int, int] | None = None,
    ):
        placement = Offloaded(lookahead=lookahead, host_budget=host_budget, folder=folder)
        full_sinks = asked_full_sinks(first_tokens, None)  # first tokens asked for: not the family's sinks
        first_tokens = preset_first_tokens(bits, first_tokens)  # a rotated preset's exact first tokens, as QuantizedCache
        regions = PrecisionRegions(window, first_tokens, boundary_layers, boundary_bits, layer_bits or {},
                                   full_sinks=full_sinks, layer_rotations=layer_rotations or {})
        if bits is None:
            if regions != PrecisionRegions(window):
                raise ConfigError(f"precision regions ({regions}) need bits: a full-precision cache is exact everywhere")
            storage = lambda spec: DenseStorage()  # noqa: E731
        else:
            scale = key_scale_for(config, key_scale) if is_rotated(bits) else None  # (QuantizedCache's `key_scale`)
            storage = quantized_storage(config, bits=bits, group_size=group_size, regions=regions,
                                        rotation_seed=rotation_seed, key_scale=scale)
        super().__init__(config, storage=storage, placement=placement)

    def close(self) -> None:
        """Removes the disk tier's files now (they also go when the cache is collected)."""
        self.placement.close()
