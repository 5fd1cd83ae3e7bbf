"""QuantizedCache: KIVI-style int8/int4/int2 and fp8 K/V with a full-precision recent window."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedConfig

from .cache import KVCache
from .errors import ConfigError
from .formats import resolve_format, rotated_bits
from .model_spec import LayerSpec, ModelSpec
from .placement.base import Placement
from .storage.quantized import DEFAULT_WINDOW, QuantizedSegment, QuantizedStorage
from .storage.static_quantized import StaticQuantizedStorage

BACKENDS = ("kvplus", "quanto")


def quantized_storage(
    config: PreTrainedConfig,
    *,
    bits: int | str = 4,
    group_size: int | None = None,
    window: int = DEFAULT_WINDOW,
    backend: str = "kvplus",
    max_tokens: int | None = None,
    rotation_seed: int = 0,
) -> Callable[[LayerSpec], QuantizedStorage | StaticQuantizedStorage]:
    """A `KVCache` storage factory holding K/V quantized: combine it with any retention.

    Checks everything at construction: the bit width, the backend, that the group size divides every
    layer's head_dim, and that the full-precision window holds at least one group. With `max_tokens`, full
    layers get a `StaticQuantizedStorage` of that capacity (sliding layers keep their growing window).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if max_tokens is not None and backend != "kvplus":
        raise ConfigError(f"max_tokens needs backend='kvplus' (its static storage packs codes itself), got {backend!r}")
    fmt = resolve_format(ModelSpec.from_config(config), bits, group_size, rotation_seed)
    if backend == "quanto" and fmt.rotated:
        raise ConfigError(f"backend='quanto' has no rotated formats, got bits={bits!r}")
    if max_tokens is not None:
        StaticQuantizedStorage(fmt, window, max_tokens)  # bad sizes fail here, not at a forward

    def segment(fmt=fmt) -> QuantizedSegment:
        if backend == "quanto":
            from .storage.quanto_segment import QuantoSegment

            return QuantoSegment(fmt)
        from .storage.packed_segment import PackedSegment

        return PackedSegment(fmt)

    QuantizedStorage(segment(), window=window)  # a bad window or a missing backend fails here, not at a forward

    def storage(spec: LayerSpec) -> QuantizedStorage | StaticQuantizedStorage:
        if max_tokens is not None and spec.kind == "full":
            return StaticQuantizedStorage(fmt.for_layer(spec.index), window, max_tokens)
        return QuantizedStorage(segment(fmt.for_layer(spec.index)), window=window)

    return storage


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
    made; prefill attends with SDPA over the dequantized past and the fresh chunk at full precision.
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
    >>> model.generate(**inputs, past_key_values=cache)
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
    ):
        if compileable and max_tokens is None:
            raise ConfigError("QuantizedCache(compileable=True) needs max_tokens: every decode step reads that many positions")
        if max_tokens is not None and placement is not None and placement.moves:
            raise ConfigError(f"max_tokens keeps the codes where attention reads them; placement {placement!r} moves them")
        bits = rotated_bits(bits, key_bits, value_bits)
        storage = quantized_storage(
            config, bits=4 if bits is None else bits, group_size=group_size, window=window, backend=backend,
            max_tokens=max_tokens, rotation_seed=rotation_seed,
        )  # fmt: skip
        super().__init__(config, storage=storage, placement=placement, compileable=compileable)
        first = next(layer.storage for layer in self.layers if hasattr(layer, "storage"))
        self.format, self.window, self.backend = first.fmt, window, backend

    def quantized_report(self) -> dict:
        """Bytes at rest of the quantized tokens alone (codes, scales and zero points; the full-precision
        window excluded), per token and as a fraction of float16 K/V for the same tokens."""
        quantized_bytes = tokens = fp16_bytes = 0
        for layer in self.layers:
            storage = getattr(layer, "storage", None)
            if storage is None:
                continue
            report, length = storage.quantized_part()
            quantized_bytes += report.payload_bytes + report.metadata_bytes
            held = length * report.batch_size
            tokens = max(tokens, held)
            fp16_bytes += held * 2 * 2 * layer.spec.num_kv_heads * layer.spec.head_dim
        return {
            "format": str(self.format),
            "backend": self.backend,
            "quantized_tokens": tokens,
            "quantized_bytes": quantized_bytes,
            "bytes_per_token": quantized_bytes / tokens if tokens else 0.0,
            "ratio_to_fp16": quantized_bytes / fp16_bytes if fp16_bytes else 0.0,
        }
