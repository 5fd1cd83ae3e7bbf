"""QuantizedCache: KIVI-style int8/int4/int2 and fp8 K/V with a full-precision recent window."""

from __future__ import annotations

import math
from collections.abc import Callable

from transformers import PreTrainedConfig

from .attention.dispatch import takes_fused_path
from .cache import KVCache
from .errors import ConfigError
from .kernels.quant_format import BIT_WIDTHS, QuantFormat
from .model_spec import LayerSpec, ModelSpec
from .placement.base import Placement
from .storage.quantized import DEFAULT_WINDOW, QuantizedSegment, QuantizedStorage

#: Default group size per format: the largest that keeps int8 under 0.56, int4 under 0.32 and int2 under
#: 0.19 of float16's bytes per token (codes plus float16 scales and zero points).
DEFAULT_GROUP = {8: 64, 4: 32, 2: 32, "fp8": 32}
BACKENDS = ("kvplus", "quanto")


def parse_bits(bits) -> int | str:
    """8, 4, 2 or "fp8"; also accepts "int8"/"int4"/"int2" and "8"/"4"/"2"."""
    given = bits
    if isinstance(bits, str):
        text = bits.strip().lower().removeprefix("int")
        bits = int(text) if text.isdigit() else text
    if isinstance(bits, bool) or bits not in BIT_WIDTHS:
        raise ConfigError(f"bits must be 8, 4, 2 or 'fp8' (int8/int4/int2/fp8), got {given!r}")
    return bits


def model_format(config: PreTrainedConfig, bits: int | str, group_size: int | None) -> QuantFormat:
    """The `QuantFormat` for every layer of `config`: default group (gcd with the head dims) and checked."""
    bits = parse_bits(bits)
    head_dims = sorted({spec.head_dim for spec in ModelSpec.from_config(config).layers if spec.holds_kv})
    if group_size is None:
        group_size = math.gcd(DEFAULT_GROUP[bits], *head_dims)
    fmt = QuantFormat(bits, group_size)
    for head_dim in head_dims:
        fmt.check_head_dim(head_dim)
    return fmt


def quantized_storage(
    config: PreTrainedConfig,
    *,
    bits: int | str = 4,
    group_size: int | None = None,
    window: int = DEFAULT_WINDOW,
    backend: str = "kvplus",
) -> Callable[[LayerSpec], QuantizedStorage]:
    """A `KVCache` storage factory holding K/V quantized: combine it with any retention.

    Checks everything at construction: the bit width, the backend, that the group size divides every
    layer's head_dim, and that the full-precision window holds at least one group.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    fmt = model_format(config, bits, group_size)
    fused = takes_fused_path(config)

    def segment() -> QuantizedSegment:
        if backend == "quanto":
            from .storage.quanto_segment import QuantoSegment

            return QuantoSegment(fmt)
        from .storage.packed_segment import PackedSegment

        return PackedSegment(fmt)

    QuantizedStorage(segment(), window=window)  # a bad window or a missing backend fails here, not at a forward
    return lambda spec: QuantizedStorage(segment(), window=window, fused=fused)


class QuantizedCache(KVCache):
    """K/V quantized KIVI-style: keys per channel over groups of tokens, values per token over groups of
    channels; int8, int4, int2 (asymmetric, float16 scale and zero point per group) or fp8 (e4m3 with a
    float16 scale per group).

    The newest `window` tokens (at least; up to one group more) stay at full precision; older tokens
    are quantized a whole group at a time, once. Decode attends over the packed codes in place (a
    Triton kernel on CUDA, its chunked torch twin elsewhere), so no full-length dequantized copy is
    made; prefill attends with SDPA over the dequantized past and the fresh chunk at full precision.
    Works for full, sliding-window and hybrid models. `backend="quanto"` quantizes the same groups with
    optimum-quanto instead (dequantized for attention), for comparison.

    Lossy: see README for the measured perplexity cost of each format and its bytes per token.

    >>> cache = QuantizedCache(config=model.config, bits=4)
    >>> model.generate(**inputs, past_key_values=cache)
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        bits: int | str = 4,
        group_size: int | None = None,
        window: int = DEFAULT_WINDOW,
        backend: str = "kvplus",
        placement: Placement | None = None,
    ):
        storage = quantized_storage(config, bits=bits, group_size=group_size, window=window, backend=backend)
        super().__init__(config, storage=storage, placement=placement)
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
            segment = storage.segment
            report = segment.memory()
            quantized_bytes += report.payload_bytes + report.metadata_bytes
            held = segment.length * segment.batch_size
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
