"""Precision regions: which tokens and layers a quantized cache keeps at full precision (or at other bits), one
description for every quantized storage.

- `window`: the newest tokens of each row (each query's window: see `QuantizedStorage`);
- `first`: the first tokens of each row (attention sinks: most attention mass falls there), in full-attention layers;
- `boundary`: the first and last `boundary` layers at full precision, or at `boundary_bits`;
- `layer_bits`: any layer's own format (`{index: bits}`, None: full precision), e.g. what `kvplus calibrate` chose;
- `sliding_sinks`: 16-bit copies of each sliding-window layer's coded tokens with the shortest values (the sinks
  inside its window, which its first tokens cannot be: they leave it; `QuantizedStorage(sinks=)`);
- `full_sinks`: the same copies in each full-attention layer, in place of its exact first tokens (which they take
  where those are the sinks) in the growing storage; a static one (`max_tokens`) keeps its first tokens;
- `layer_rotations`: layers rotated with a seed of their own (`{index: seed}`, a rotated format's), e.g. what
  `kvplus calibrate --rotations` chose, in place of the cache's `rotation_seed + index`;
- family defaults (`FAMILY_DEFAULTS`, `family_regions`): the `layer_bits` a rotated preset takes on a model family
  where measurements showed the preset's one format for every layer costs far more than elsewhere (Gemma 3).

Bits per coordinate (`QuantizedCache.quantized_report`) count every token outside the window, these regions included.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from transformers import PreTrainedConfig

from .errors import ConfigError
from .formats import is_rotated, parse_bits
from .kernels.kv_format import KVFormat, state_kw
from .memory import tensor_bytes
from .model_spec import ModelSpec
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
    #: 16-bit copies per row of each sliding-window layer's coded tokens with the shortest values; None: the model
    #: family's default for the preset (`FamilyDefaults.sliding_sinks`), else none.
    sliding_sinks: int | None = None
    #: The same copies in each full-attention layer, in place of its `first` tokens (growing storages; a static one
    #: keeps `first`); None: the family's default for the preset (`FamilyDefaults.full_sinks`), else none.
    full_sinks: int | None = None
    #: Layers rotated with a seed of their own, as sorted `(index, seed)` pairs (given as a mapping), in place of the
    #: cache's `rotation_seed + index`; each must hold a rotated format (`check_rotations`).
    layer_rotations: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        for name in ("first", "boundary", "sliding_sinks", "full_sinks"):
            value = getattr(self, name)
            if value is None and name.endswith("_sinks"):
                continue
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
        given = self.layer_rotations
        rotations = tuple(sorted(given.items() if isinstance(given, Mapping) else given))
        for index, seed in rotations:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ConfigError(f"layer_rotations keys must be layer indices (ints >= 0), got {index!r}")
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ConfigError(f"layer_rotations gives layer {index} seed {seed!r}: a rotation seed is an int")
        object.__setattr__(self, "layer_rotations", rotations)

    def is_boundary(self, index: int, num_layers: int) -> bool:
        """Whether layer `index` of `num_layers` is one of the first or last `boundary`."""
        return index < self.boundary or index >= num_layers - self.boundary

    def check_layers(self, num_layers: int) -> None:
        """Refuses `layer_bits` and `layer_rotations` entries past the model's layers."""
        for name, pairs in (("layer_bits", self.layer_bits), ("layer_rotations", self.layer_rotations)):
            beyond = [index for index, _ in pairs if index >= num_layers]
            if beyond:
                raise ConfigError(f"{name} names layers {beyond}, but the model has {num_layers} (0..{num_layers - 1})")

    def check_rotations(self, num_layers: int, bits: int | str | None) -> None:
        """Refuses a rotation seed for a layer whose format (`bits_of`) has no rotation."""
        for index, seed in self.layer_rotations:
            held = self.bits_of(index, num_layers, bits)
            if held is None or not is_rotated(held):
                raise ConfigError(f"layer_rotations gives layer {index} rotation seed {seed}, but it holds "
                                  f"{held if held is not None else 'full precision'}: only a rotated format "
                                  "(k<key bits>v<value bits>) rotates")  # fmt: skip

    def layer_format(self, fmt: KVFormat, index: int) -> KVFormat:
        """Layer `index`'s format: `fmt.for_layer(index)`, with the seed `layer_rotations` gives it (checked rotated:
        `check_rotations`)."""
        made = fmt.for_layer(index)
        seed = dict(self.layer_rotations).get(index)
        return made if seed is None else replace(made, seed=seed)

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


@dataclass(frozen=True)
class FamilyDefaults:
    """What a rotated preset holds on one model family, by layer kind: `kind_bits[preset][kind]` is the format of
    that kind of layer ("full", "sliding"; a kind not named keeps the preset's format). Found from the config's
    `model_type` (or its text config's), applied only where no layer formats were asked for (`family_regions`)."""

    family: str
    model_types: tuple[str, ...]
    kind_bits: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: Why, in one line: what was measured (docs/benchmarks-lowbit.md has the tables).
    why: str = ""
    #: `sliding_sinks[preset]`: the sinks' copies each sliding-window layer keeps with that preset (`PrecisionRegions`).
    sliding_sinks: Mapping[str, int] = field(default_factory=dict)
    #: `full_sinks[preset]`: the sinks' copies each full-attention layer keeps with that preset, in place of its first
    #: tokens (`PrecisionRegions`).
    full_sinks: Mapping[str, int] = field(default_factory=dict)

    def layer_bits(self, spec: ModelSpec, bits: int | str) -> dict[int, str]:
        """`layer_bits` of preset `bits` on a model of this family: the layers whose kind has a format of its own."""
        bits = parse_bits(bits)
        kinds = self.kind_bits.get(bits, {})
        return {layer.index: kinds[layer.kind] for layer in spec.layers
                if layer.holds_kv and kinds.get(layer.kind, bits) != bits}  # fmt: skip


#: Per-family defaults of the rotated presets, chosen with the model's key scale on (`key_scale.KeyScale`, shipped for
#: Gemma 3 270M and on by default). Gemma 3 (1 KV head of 256, QK-norm, 5 sliding-window layers of 512 per
#: full-attention layer): its full-attention layers' keys are long and attend far (at 4K tokens those 3 layers hold two
#: thirds of the coded tokens); the key scale takes most of their key error away (k2v2 on every layer +57% -> +10%), and
#: what is left is best spent as 3-bit keys with more value bits there (4-bit keys alone cost +0.7% there, 2-bit values
#: +1.5%): Gemma 3 270M, 4,096 tokens of Pride and Prejudice in chunks of 32, window 128, seed 0, with the scale: k2v2
#: +9.23% -> +4.38% (full k4v1 and sliding k3v1 before), k3v2 +3.27% -> +1.94% (full k4v2 before) at the same bits
#: (eval/key_scaling.py `shipped`; docs/artifacts.md, "A key scale per model"). Without the scale (`key_scale="off"`)
#: these formats were not what measured best.
#: Sliding layers' sinks (4 a row, 16-bit copies beside the codes): a token inside each 512-token window takes up to
#: half of its last queries' attention and has a short value, so its coding error goes whole into the output; kept,
#: k2v2 on P&P went +4.39% -> +1.40%, k3v2 +1.94% -> -0.23%, k4v2 +1.48% -> +0.53% (seed 0; docs/benchmarks-lowbit.md,
#: "Two model families": seeds 0-2 and both texts) for about 0.05 bits a coordinate at 4K tokens. With them, k2v2's
#: sliding layers hold k2v2 rather than k3v1 (the sinks took the tokens whose 1-bit values cost most): pattern.txt
#: seeds 0 / 1 / 2 +2.88 / +3.31 / +3.77% -> +2.53 / +2.87 / +3.13%, P&P +1.40 / +3.65 / +1.11% -> +1.89 / +3.35 /
#: +1.09%, at the same bits (`eval/lowbit_probes.py runs`; docs/artifacts.md, "Each sliding window's sinks").
#: Full layers' sinks (16 a row, in place of the 4 exact first tokens): the full layers' attention piles onto recurring
#: tokens (full stops, quotes, newlines) whose errors one rotation makes alike, so they add up; the seeds' spread was
#: the full layers' rotations (docs/benchmarks-lowbit.md, "Which rotations"). Kept, 3-seed means P&P / pattern.txt,
#: k2v2 +2.11 / +2.84% -> +1.48 / +2.30%, k3v2 +0.32 / +1.32% -> +0.28 / +0.96%, k4v2 +0.44 / +0.80% -> +0.00 / +0.50%,
#: for 0.025 bits a coordinate at 4K tokens (eval/results/lowbit_families_4k/diagnosis.md).
FAMILY_DEFAULTS: tuple[FamilyDefaults, ...] = (
    FamilyDefaults(
        "Gemma 3", ("gemma3_text", "gemma3"),
        {"k2v2": {"full": "k3v2"}, "k3v2": {"full": "k3v3"}, "k4v2": {"full": "k4v3"}},
        "full-attention layers' keys long and attended far: with the key scale, 3-bit keys and more value bits there; "
        "each sliding window's sinks (short values, up to half its attention) kept beside the codes at 16 bits, and "
        "each full layer's 16 in place of its first tokens",
        {"k2v2": 4, "k3v2": 4, "k4v2": 4},
        {"k2v2": 16, "k3v2": 16, "k4v2": 16},
    ),
)  # fmt: skip


def family_of(config: PreTrainedConfig) -> FamilyDefaults | None:
    """The `FAMILY_DEFAULTS` entry of a model's config (by `model_type`, or its text config's), or None."""
    types = {getattr(config, "model_type", None)}
    text = getattr(config, "get_text_config", None)
    if text is not None:
        types.add(getattr(text(), "model_type", None))
    return next((family for family in FAMILY_DEFAULTS if types & set(family.model_types)), None)


def family_regions(config: PreTrainedConfig, bits: int | str | None, regions: PrecisionRegions) -> PrecisionRegions:
    """`regions` with its model family's layer formats for preset `bits` (`FAMILY_DEFAULTS`), where the regions ask
    for no layer formats of their own (no `layer_bits`, boundary layers or calibration), and its sliding layers'
    sinks where the regions leave them to the family (`sliding_sinks` None), and its full layers' (`full_sinks` None);
    else `regions` as given."""
    family = family_of(config)
    if family is None or bits is None:
        return regions
    preset = parse_bits(bits)
    if regions.sliding_sinks is None and preset in family.sliding_sinks:
        regions = replace(regions, sliding_sinks=family.sliding_sinks[preset])
    if regions.full_sinks is None and preset in family.full_sinks:
        regions = replace(regions, full_sinks=family.full_sinks[preset])
    if regions.overrides() or preset not in family.kind_bits:
        return regions
    return replace(regions, layer_bits=family.layer_bits(ModelSpec.from_config(config), bits))


def precision_report(cache, format_name: str, window: int, key_scale=None) -> dict:
    """`quantized_report` of a cache (a `KVCache`) whose layers hold a `QuantizedStorage` (contiguous or paged),
    `StaticQuantizedStorage`, `SlotStore` (through their `quantized_part` and `exact_part`) or, at full precision, a
    `DenseStorage` or `PagedStorage` (a boundary or sliding layer: every token past the `window` counts at its dtype's
    bits). `derived_bytes`: the tables its formats' decode reads that are derived from the model alone (a turning key
    centre's position tables), counted once per cache and not in bytes at rest (made again after a load, not saved).
    `key_scale`: the model the cache's key scale (a `KeyScale`, or None) was fitted on. First raises what a decode step gave that the codes cannot hold (`storage.value_range`)."""
    raise_pending(cache.layers)
    quantized_bytes = tokens = fp16_bytes = 0
    region_bits = region_coordinates = 0
    derived, seen = 0, set()
    for layer in cache.layers:
        storage = getattr(layer, "storage", None)
        if storage is None:
            continue
        derived += tensor_bytes([t for fmt, state in zip(storage.formats(), storage.states(), strict=True)
                                 for t in fmt.derived_tensors(**state_kw(state))], seen)  # fmt: skip
        bits, coordinates = layer_region_bits(layer, window)
        region_bits += bits
        region_coordinates += coordinates
        part = storage.quantized_part()
        if part is None:
            continue
        report, length = part
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
        "derived_bytes": derived,
        "key_scale": None if key_scale is None else key_scale.model,
    }


def layer_region_bits(layer, window: int) -> tuple[int, int]:
    """One layer's share of `bits_per_coordinate`: the bits it holds outside the `window` (codes, scales and zeros,
    exact regions at their dtype's bits) and the coordinates they hold; (0, 0) for a layer without a storage."""
    storage = getattr(layer, "storage", None)
    if storage is None:
        return 0, 0
    coordinates = 2 * layer.spec.num_kv_heads * layer.spec.head_dim  # of one token of one row
    part = storage.quantized_part()
    if part is None:  # a full-precision layer: every token past the window counts
        outside = max(0, storage.length - window) * storage.batch_size
        held = next(iter(storage.tensors().values()), None)  # (a buffer or a block pool)
        bits = 0 if held is None else held.element_size() * 8
        return outside * coordinates * bits, outside * coordinates
    report, length = part
    exact, element_size = storage.exact_part()
    exact *= storage.batch_size
    held = length * report.batch_size
    coded = report.payload_bytes + report.metadata_bytes
    copies, copy_size = storage.sinks_part()
    copies = copies * storage.batch_size * coordinates * copy_size * 8  # (bits of tokens already counted as coded)
    return coded * 8 + exact * coordinates * element_size * 8 + copies, (held + exact) * coordinates
