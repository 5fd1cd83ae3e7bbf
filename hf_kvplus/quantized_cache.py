"""QuantizedCache: KIVI-style int8/int4/int2 and fp8 K/V with a full-precision recent window."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from transformers import PreTrainedConfig

from .cache import KVCache
from .calibration import Calibration
from .errors import ConfigError, UnsupportedModelError
from .eviction.rope import RotaryShift
from .fitted import calibrated_layers, key_scale_for
from .formats import any_rotated, is_rotated, layer_state, parse_bits, resolve_format, rotated_bits
from .kernels.quant_format import QuantFormat
from .kernels.turning_center import RotaryBasis
from .key_scale import KeyScale
from .model_spec import LayerSpec, ModelSpec
from .placement.base import Placement
from .precision import PrecisionRegions, family_of, family_regions, precision_report
from .storage.base import KVStorage
from .storage.dense import DenseStorage
from .storage.quantized import DEFAULT_WINDOW, QuantizedSegment, QuantizedStorage
from .storage.static_quantized import StaticQuantizedStorage

BACKENDS = ("kvplus", "quanto")

#: The exact first tokens (attention sinks) each rotated preset keeps by default: `QuantizedCache(bits="k4v2")`,
#: `quantized:k4v2`, `OffloadedCache(bits="k4v2")`. Measured on two texts and three rotation seeds (docs/benchmarks-lowbit.md,
#: "Exact regions"); `first_tokens=0` (spec `first=0`) turns it off, another number replaces it.
PRESET_FIRST_TOKENS: dict[str, int] = {"k4v2": 4, "k3v2": 4, "k2v2": 4}


def preset_first_tokens(bits, first_tokens: int | None) -> int:
    """`first_tokens` as given; None: the preset's (`PRESET_FIRST_TOKENS`) for a rotated `bits`, else 0."""
    if first_tokens is not None:
        return first_tokens
    return 0 if bits is None else PRESET_FIRST_TOKENS.get(parse_bits(bits), 0)


def asked_full_sinks(first_tokens: int | None, full_sinks: int | None) -> int | None:
    """`full_sinks` as a cache asks them of `PrecisionRegions`: as given, but 0 where `first_tokens` was given and
    `full_sinks` not (the full layers' exact tokens were asked for: the family's sinks, which take their place, do not
    apply); both given above 0 is a `ConfigError`."""
    if first_tokens is None or full_sinks == 0:
        return full_sinks
    if full_sinks is None:
        return 0
    if first_tokens:
        raise ConfigError(f"full_sinks={full_sinks} take the place of the full layers' exact first tokens "
                          f"(first_tokens={first_tokens}): give one or the other")
    return full_sinks


def quantized_storage(
    config: PreTrainedConfig,
    *,
    bits: int | str = 4,
    group_size: int | None = None,
    window: int = DEFAULT_WINDOW,
    backend: str = "kvplus",
    max_tokens: int | None = None,
    rotation_seed: int = 0,
    regions: PrecisionRegions | None = None,
    turning_keys: bool | None = None,
    family_defaults: bool = True,
    key_scale: KeyScale | None = None,
) -> Callable[[LayerSpec], KVStorage]:
    """A `KVCache` storage factory holding K/V quantized: combine it with any retention.

    Checks everything at construction: the bit width, the backend, that the group size divides every
    layer's head_dim, and that the full-precision window holds at least one group. With `max_tokens`, full
    layers get a `StaticQuantizedStorage` of that capacity (sliding layers keep their growing window).
    `regions` (`PrecisionRegions`; its window replaces `window`) keeps the first tokens of full layers and the
    boundary layers at full precision (or the boundary layers at `boundary_bits`), 16-bit copies of sliding layers'
    sinks, and gives `layer_bits`'s layers their own format. `turning_keys`, `family_defaults`: see `QuantizedCache`.
    `key_scale` (checked against the config): the key scale of each layer held in a rotated format (`KeyCenter.scale`).
    """
    regions = regions or PrecisionRegions(window=window)
    if family_defaults:
        regions = family_regions(config, bits, regions)
    window = regions.window
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if max_tokens is not None and backend != "kvplus":
        raise ConfigError(f"max_tokens needs backend='kvplus' (its static storage packs codes itself), got {backend!r}")
    model = ModelSpec.from_config(config)
    regions.check_layers(model.num_layers)
    regions.check_rotations(model.num_layers, bits)
    fmt = resolve_format(model, bits, group_size, rotation_seed)
    formats = {bits: fmt}  # by bits, every layer's (a layer's own grouped format takes the cache's `group_size`)
    for own in set(regions.own_bits(model.num_layers).values()) - {bits}:
        grouped = own is not None and not is_rotated(own)
        formats[own] = resolve_format(model, own, group_size if grouped else None, rotation_seed)
    if backend == "quanto" and any(f is not None and not isinstance(f, QuantFormat) for f in formats.values()):
        raise ConfigError(f"backend='quanto' codes the KIVI formats only (int8, int4, int2, fp8), got bits={bits!r} (or a "
                          "layer's own bits)")
    if max_tokens is not None:
        StaticQuantizedStorage(fmt, window, max_tokens, regions.first)  # bad sizes fail here, not at a forward
    turns = turning_basis(config, turning_keys, any(f is not None and f.turns_keys for f in formats.values()))

    def segment(fmt=fmt, state=None) -> QuantizedSegment:
        if backend == "quanto":
            from .storage.quanto_segment import QuantoSegment

            return QuantoSegment(fmt)
        from .storage.packed_segment import PackedSegment

        return PackedSegment(fmt, state)

    for checked in formats.values():  # a bad window or a missing backend fails here, not at a forward
        if checked is not None:
            QuantizedStorage(segment(checked), window=window)

    def storage(spec: LayerSpec) -> KVStorage:
        layer_fmt = formats[regions.bits_of(spec.index, model.num_layers, bits)]
        static = max_tokens is not None and spec.kind == "full"
        if layer_fmt is None:  # a layer at full precision
            return DenseStorage(max_tokens=max_tokens if static else None, static=static)
        first = regions.first if spec.kind == "full" else 0
        sinks = (regions.sliding_sinks or 0) if spec.kind == "sliding" else 0
        if spec.kind == "full" and regions.full_sinks and not static:  # (in place of the first tokens)
            first, sinks = 0, regions.full_sinks
        if turns is not None and layer_fmt.turns_keys and spec.kind == "full":  # the keys' centre turns with RoPE
            # index 0 at the position of the storage's first code: token p at code p in the static storage, after
            # the exact first tokens in the growing one
            state = layer_state(layer_fmt, spec.index, key_scale, turns=turns, origin=0 if static else first)
        else:
            state = layer_state(layer_fmt, spec.index, key_scale)
        layer_fmt = regions.layer_format(layer_fmt, spec.index)
        if static:
            return StaticQuantizedStorage(layer_fmt, window, max_tokens, first, state)
        return QuantizedStorage(segment(layer_fmt, state), window=window, first=first, sinks=sinks)

    return storage


def turning_basis(config: PreTrainedConfig, turning_keys: bool | None, rotated: bool) -> RotaryBasis | None:
    """The rotary basis that a rotated format's key centre turns with (`kernels/turning_center.py`), or None: a fixed
    centre. `turning_keys` None: turning where it can (rotated formats, a model with rotate-half RoPE), True: turning
    or a `ConfigError` saying why not, False: fixed."""
    if turning_keys is False or (turning_keys is None and not rotated):
        return None
    why = None
    if not rotated:
        why = "only a rotated format's keys have a centre"
    else:
        try:
            shift = RotaryShift.from_config(config)
        except UnsupportedModelError as exc:
            why = str(exc)
    if why is None:
        return shift  # a RotaryShift is the RotaryBasis of the model's RoPE
    if turning_keys:
        raise ConfigError(f"turning_keys=True: the keys' centre cannot turn here ({why})")
    return None


class QuantizedCache(KVCache):
    """K/V quantized KIVI-style: keys per channel over groups of tokens, values per token over groups of
    channels; int8, int4, int2 (asymmetric, float16 scale and zero point per group) or fp8 (e4m3 with a
    float16 scale per group). Or rotated (the TurboQuant class): `key_bits`/`value_bits` (1, 2, 3, 4 or 8 each;
    or `bits="k4v2"`) code each head vector after a seeded rotation with a fixed Lloyd-Max codebook and one
    float16 norm, and decode attends in the rotated space (`kernels/rotated_format.py`); `rotation_seed` picks the
    rotations (layer i's seed is rotation_seed + i).

    The newest `window` tokens (at least; up to one group more) stay at full precision; older tokens
    are quantized a whole group at a time, once. Decode attends over the packed codes in place (a
    Triton kernel on CUDA, its chunked torch twin elsewhere), so no full-length dequantized copy is
    made; prefill attends with SDPA over the dequantized past, and each query sees its own window at full precision:
    a chunk of n tokens attends to the newest `window + n - 1` exact, though it pushes the past's window out.

    Precision regions (`PrecisionRegions`): `first_tokens` keeps the first tokens of each row of full-attention layers
    at full precision (attention sinks; with left padding, a padded row's first positions are its padding); left at
    None it is the preset's: 4 for k4v2, k3v2 and k2v2 (`PRESET_FIRST_TOKENS`), 0 otherwise; `first_tokens=0` turns
    it off;
    `boundary_layers` keeps the first and last that many layers at full precision, or at `boundary_bits`;
    `layer_bits` (`{layer index: bits}`, None: full precision) gives any layer a format of its own: what `kvplus
    calibrate` chooses; `layer_rotations` (`{layer index: seed}`) rotates those layers (each holding a rotated format)
    with a seed of their own in place of `rotation_seed + index` (what `kvplus calibrate --rotations` chooses: the one
    of several rotations that measured least divergence); `calibration` gives both from a calibration instead: "auto" (this model's, found from the config
    in the user cache folder or the package data, which holds SmolLM2-135M's k4v2, k3v2 and k2v2 and Gemma 3 270M's
    k4v2: `fitted.calibration_for`; spec `calibration=auto`), a `Calibration` or the path of its file (spec
    `calibration=PATH`), checked against the model and the format (`CacheMismatchError`, `ConfigError`).
    `quantized_report()["bits_per_coordinate"]` counts them with the codes.
    `family_defaults` (True): where no layer formats are asked for (`layer_bits`, `boundary_layers`, `calibration`),
    a rotated preset takes its model family's layer formats (`precision.FAMILY_DEFAULTS`: on Gemma 3, k2v2 holds its
    full-attention layers at k3v2, measured with the key scale and sliding sinks on); `quantized_report()["family_defaults"]`
    names the family; False: the preset's format on every layer.
    `sliding_sinks`: each sliding-window layer keeps 16-bit copies of that many coded tokens of each row with the
    shortest values (the sinks inside its window, where its attention piles up: `QuantizedStorage(sinks=)`; spec
    `sliding_sinks=N`), counted in `bits_per_coordinate`; None: the family's default (Gemma 3's rotated presets: 4),
    else 0.
    `full_sinks`: each full-attention layer keeps such copies of that many coded tokens of each row, in place of its
    exact first tokens (the tokens its attention piles onto are not all first: a full stop, a newline; the first
    tokens are among the shortest values where they are sinks); spec `full_sinks=N`; None: the family's default
    (Gemma 3's rotated presets: 16), else 0; `first_tokens` given without it: 0 (the full layers' first tokens as
    asked), both above 0: a `ConfigError`. A static storage (`max_tokens`) keeps its first tokens instead.
    `key_scale` ("auto"): a rotated format's keys coded times a per-layer, per-RoPE-pair scale and read with the query
    divided by it (`key_scale.KeyScale`, `KeyCenter.scale`: the logits the same, the coding error spent where the
    queries read): "auto" takes this model's, found from the config as calibrations are (the package data holds
    Gemma 3 270M's; a model without one is not scaled), None or "off" none (spec `key_scale=off`), or a `KeyScale`
    or the path of its file; `quantized_report()["key_scale"]` names the model it was fitted on.
    `turning_keys`: a rotated format's keys are coded relative to a centre per KV head; by default (None) on
    full-attention layers (growing or `max_tokens`'s static storage) that centre turns with RoPE, the keys' pre-RoPE
    mean at each key's position (`kernels/turning_center.py`; spec `center=turning`), which codes a model's keys with
    about a quarter less divergence from full precision than a fixed centre at the same bytes (BENCHMARKS.md,
    "turning key centre");
    False (spec `center=fixed`): one fixed centre per head, as sliding layers and models without rotate-half RoPE
    have; True: turning or a `ConfigError` saying why not.
    Works for full, sliding-window and hybrid models. `backend="quanto"` quantizes the same groups with
    optimum-quanto instead (dequantized for attention), for comparison.

    Lossy: see README for the measured perplexity cost of each format and its bytes per token.

    `max_tokens` fixes the capacity of full-attention layers (`StaticQuantizedStorage`: codes for the `max_tokens -
    window` positions a token can leave the window from and a full-precision ring of `window + 2 * group_size`
    tokens, allocated at the first fill; more raises `CapacityError`). The same tokens are quantized in the same
    groups as without it, and every step reads all positions, masked. With it, `compileable=True` (a model whose
    layers are all full attention) declares `is_compileable`: `generate()` compiles the decode forward as it does
    StaticCache's.

    >>> cache = QuantizedCache(config=model.config, bits=4)
    >>> cache = QuantizedCache(config=model.config, key_bits=4, value_bits=2)  # rotated, 3.25 bits per coordinate
    >>> cache = QuantizedCache(config=model.config, bits="k3v2", first_tokens=4, boundary_layers=1)
    >>> cache = QuantizedCache(config=model.config, bits="k4v2", calibration="auto")  # this model's layer formats
    >>> model.generate(**inputs, cache=cache)  # past_key_values=cache before Transformers 5.24
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        bits: int | str | None = None,
        group_size: int | None = None,
        window: int = DEFAULT_WINDOW,
        backend: str = "kvplus",
        placement: Placement | None = None,
        key_bits: int | None = None,
        value_bits: int | None = None,
        rotation_seed: int = 0,
        max_tokens: int | None = None,
        compileable: bool = False,
        first_tokens: int | None = None,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
        turning_keys: bool | None = None,
        calibration: Calibration | str | Path | None = None,
        family_defaults: bool = True,
        key_scale: KeyScale | str | Path | None = "auto",
        sliding_sinks: int | None = None,
        full_sinks: int | None = None,
        layer_rotations: Mapping[int, int] | None = None,
    ):
        if compileable and max_tokens is None:
            raise ConfigError("QuantizedCache(compileable=True) needs max_tokens: every decode step reads that many positions")
        if max_tokens is not None and placement is not None and placement.moves:
            raise ConfigError(f"max_tokens keeps the codes where attention reads them; placement {placement!r} moves them")
        bits = rotated_bits(bits, key_bits, value_bits)
        full_sinks = asked_full_sinks(first_tokens, full_sinks)
        first_tokens = preset_first_tokens(bits, first_tokens)
        layer_bits, layer_rotations = calibrated_layers(config, 4 if bits is None else bits, calibration, layer_bits,
                                                        key_scale, layer_rotations)  # fmt: skip
        asked = PrecisionRegions(window, first_tokens, boundary_layers, boundary_bits, layer_bits or {}, sliding_sinks,
                                 full_sinks, layer_rotations or {})
        self.regions = family_regions(config, bits, asked) if family_defaults else asked
        #: The model family whose defaults gave the layer formats (`precision.FAMILY_DEFAULTS`), or None.
        self.family = family_of(config) if self.regions != asked else None
        #: The keys' scale (`KeyScale`) where a rotated format codes them, or None.
        self.key_scale = key_scale_for(config, key_scale) if any_rotated(
            bits, self.regions.boundary_bits, *(b for _, b in self.regions.layer_bits)) else None  # fmt: skip
        storage = quantized_storage(
            config, bits=4 if bits is None else bits, group_size=group_size, backend=backend,
            max_tokens=max_tokens, rotation_seed=rotation_seed, regions=self.regions, turning_keys=turning_keys,
            family_defaults=False, key_scale=self.key_scale,
        )  # fmt: skip
        super().__init__(config, storage=storage, placement=placement, compileable=compileable)
        self.format = resolve_format(self.model_spec, 4 if bits is None else bits, group_size, rotation_seed)
        self.window, self.backend = window, backend

    def quantized_report(self) -> dict:
        """Bytes at rest of the quantized tokens alone (codes, scales and zero points; the full-precision
        window excluded), per token and as a fraction of float16 K/V for the same tokens; and `bits_per_coordinate`
        over every token outside the window, the full-precision regions (first tokens, boundary layers) included at
        their dtype's bits."""
        family = None if self.family is None else self.family.family
        return precision_report(self, str(self.format), self.window, self.key_scale) | {
            "backend": self.backend, "family_defaults": family}
