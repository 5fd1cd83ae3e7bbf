"""The memory plan of a model: weights + KV-cache bytes, and the largest context or batch that fits.

Tokens held per layer, per batch row, at a context of ``n`` tokens:

- full-attention layers hold all ``n`` tokens;
- sliding-window (and chunked) layers hold ``min(n, window)``: the peak during a decode step, when the
  ``window - 1`` tokens a cache keeps between steps meet the new one;
- an eviction ``budget`` (sinks + recent window + heavy hitters: everything an evicting cache keeps)
  caps every layer at ``budget`` tokens.

Of the tokens a layer holds, the quantized formats (KIVI int8/int4/int2/fp8 and rotated kXvY, as
`QuantizedCache` stores them) keep the first ``first_tokens`` of full-attention layers (the presets' exact
sinks: 4 for k4v2, k3v2 and k2v2, 0 otherwise and with an eviction budget, `PRESET_FIRST_TOKENS`) and the most
recent ``residual`` of the rest at full precision, counted as fp16, and the rest quantized (see
:mod:`hf_kvplus.planning.formats` for the layouts, and for the up to ``G - 1`` extra full-precision tokens the
cache may hold with a KIVI format). ``group_size=None`` means the
cache's default group for a KIVI format; the formats without groups (fp32/fp16/bf16 and the rotated ones)
ignore `group_size`. KV bytes are payload, scales and zero points, exactly; growth headroom a cache may allocate
ahead (``DenseCache`` rounds its buffers up and grows them by an eighth) and block-table metadata are
not counted, nor are activations, the CUDA context or allocator fragmentation: leave a margin for them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from transformers import PreTrainedConfig

from ..errors import CapacityError, ConfigError
from ..model_spec import ModelSpec
from ..quantized_cache import preset_first_tokens
from .configs import config_name, load_config
from .formats import (
    DEFAULT_RESIDUAL,
    KV_FORMATS,
    KVFormat,
    kv_format,
    residual_bytes,
    resolve_group_size,
    weight_bits,
)
from .parameters import ParameterCount, count_parameters
from .units import format_bytes, parse_memory


@dataclass(frozen=True)
class LayerKindPlan:
    """The layers of one kind (and window) in a plan.

    `tokens_held` is per layer and batch row, `tokens_full_precision` how many of them are held at full precision
    (quantized formats: the first tokens and the recent window; 0 otherwise), `bound` the most tokens these layers
    ever hold (the window or the budget; None when they grow with the context). `kv_bytes` covers all these
    layers and the whole batch; `bytes_per_token` is what one more held token costs all these layers for one
    batch row, in the storage format (scales included, fp16 window excluded).
    """

    kind: str
    window: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bound: int | None
    tokens_held: int
    tokens_full_precision: int
    kv_bytes: int
    bytes_per_token: int


@dataclass(frozen=True)
class Plan:
    """Weights and KV-cache bytes of one model at one context, batch and cache format.

    Per-token figures are for one batch row:

    - `kv_bytes_per_token` = ``kv_bytes / (batch x context)``: what each sequence token costs on average
      at this context, everything included (sliding layers saturated at their window, the fp16 recent
      window of the quantized formats); 0.0 at context 0.
    - `kv_bytes_per_token_excl_residual`: what one token held by every KV layer costs in the storage
      format, scales and zero points included, the fp16 recent window excluded. For fp16 it is the
      textbook ``2 x layers x kv_heads x head_dim x 2`` (131,072 for Llama 3.1 8B).
    - `kv_bytes_per_token_asymptotic`: how much the KV bytes grow per extra token far past every window,
      i.e. the same figure over the layers whose tokens are not bounded by a window or budget (the full
      layers); 0 when every layer is bounded.
    - `ratio_to_fp16`: `kv_bytes_per_token_excl_residual` over the same figure in fp16.

    `group_size` is the group size in use (the cache's default for the format unless one was given);
    it is None for the formats without groups (fp32/fp16/bf16 and the rotated kXvY), and `residual` is 0 for
    the unquantized ones (fp32/fp16/bf16).
    `total_bytes` is ``weights_bytes + kv_bytes``. With `tp` > 1 (tensor parallel ranks) every byte figure is
    one rank's: each holds `num_kv_heads / tp` KV heads of every layer, and a `tp`-th of the weights (nominal:
    Transformers' plans shard the projections, embeddings and head; the norms, replicated, are negligible).
    """

    model: str
    model_type: str
    kv_format: str
    context: int
    batch: int
    group_size: int | None
    residual: int
    first_tokens: int
    budget: int | None
    weights_dtype: str
    num_parameters: int
    weights_bytes: int
    kv_bytes: int
    kv_bytes_per_token: float
    kv_bytes_per_token_excl_residual: int
    kv_bytes_per_token_asymptotic: int
    ratio_to_fp16: float
    layer_kinds: tuple[LayerKindPlan, ...]
    max_position_embeddings: int | None
    tp: int = 1

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    def to_dict(self) -> dict:
        """Every field, `total_bytes` included, as plain JSON-ready values."""
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}

    def __str__(self) -> str:
        return (
            f"{self.model} {self.kv_format} context={self.context:,} batch={self.batch}: KV "
            f"{self.kv_bytes_per_token:,.1f} B/token, {format_bytes(self.kv_bytes)}; weights "
            f"{format_bytes(self.weights_bytes)} ({self.weights_dtype}); "
            f"total {format_bytes(self.total_bytes)}"
        )


@dataclass(frozen=True)
class _Group:
    kind: str
    window: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class _Model:
    name: str
    model_type: str
    groups: tuple[_Group, ...]  # one rank's KV heads
    parameters: ParameterCount
    max_position_embeddings: int | None
    tp: int


@dataclass(frozen=True)
class _Settings:
    fmt: KVFormat
    group_size: int | None
    residual: int
    budget: int | None
    weights_dtype: str
    first_tokens: int


def _model(config: str | PreTrainedConfig, tp: int = 1) -> _Model:
    if not _is_int(tp) or tp < 1:
        raise ConfigError(f"tp (tensor-parallel ranks) must be an int of at least 1, got tp={tp!r}")
    loaded = load_config(config)
    spec = ModelSpec.from_config(loaded)
    layers = [layer for layer in spec.layers if layer.holds_kv]
    uneven = sorted({layer.num_kv_heads for layer in layers if layer.num_kv_heads % tp})
    if uneven:
        raise ConfigError(
            f"{spec.model_type}: {uneven[0]} KV heads cannot be split evenly over tp={tp} ranks (Transformers' "
            "tensor parallelism shards whole heads)"
        )
    counts = Counter(
        (layer.kind, layer.window if layer.kind != "full" else None, layer.num_kv_heads // tp, layer.head_dim)
        for layer in layers
    )
    groups = tuple(_Group(kind, window, n, kv, hd) for (kind, window, kv, hd), n in counts.items())
    text = loaded.get_text_config(decoder=True)
    return _Model(
        name=config_name(config),
        model_type=spec.model_type,
        groups=groups,
        parameters=count_parameters(loaded),
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        tp=tp,
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _settings(model: _Model, kv_format_name, group_size, residual, budget, weights_dtype, first_tokens=None) -> _Settings:
    fmt = kv_format(kv_format_name)
    weight_bits(weights_dtype)
    group_size = resolve_group_size(fmt, group_size, {g.head_dim for g in model.groups})
    if budget is not None and (not _is_int(budget) or budget < 1):
        raise ConfigError(f"an eviction budget must keep at least 1 token per layer, got budget={budget!r}")
    if fmt.is_quantized and (not _is_int(residual) or residual < 0):
        raise ConfigError(
            f"residual (fp16 recent window) must be 0 or more tokens, got residual={residual!r}"
        )
    if first_tokens is None:  # the preset's, as `QuantizedCache` takes it (an evicting cache takes none)
        first_tokens = preset_first_tokens(fmt.cache_bits, None) if budget is None else 0
    elif not _is_int(first_tokens) or first_tokens < 0:
        raise ConfigError(f"first_tokens (exact first tokens) must be 0 or more, got first_tokens={first_tokens!r}")
    first = first_tokens if fmt.is_quantized else 0
    return _Settings(fmt, group_size, residual if fmt.is_quantized else 0, budget, str(weights_dtype).lower(), first)


def _check_context(context) -> None:
    if not _is_int(context) or context < 0:
        raise ConfigError(f"context must be a non-negative number of tokens, got context={context!r}")


def _check_batch(batch) -> None:
    if not _is_int(batch) or batch < 1:
        raise ConfigError(f"batch must be at least 1 sequence, got batch={batch!r}")


def _bound(group: _Group, budget: int | None) -> int | None:
    bounds = [b for b in (group.window if group.kind != "full" else None, budget) if b is not None]
    return min(bounds) if bounds else None


def _weights_bytes(model: _Model, settings: _Settings) -> int:
    """One rank's weights: a `tp`-th of them, rounded up."""
    return -(-model.parameters.total * weight_bits(settings.weights_dtype) // (8 * model.tp))


def _evaluate(model: _Model, settings: _Settings, context: int, batch: int) -> Plan:
    fmt, group_size = settings.fmt, settings.group_size
    fp16 = KV_FORMATS["fp16"]
    head_dims = tuple(sorted({g.head_dim for g in model.groups}))  # (what a registered format's maker is given)
    kinds = []
    for group in model.groups:
        bound = _bound(group, settings.budget)
        held = context if bound is None else min(context, bound)
        first = min(held, settings.first_tokens) if group.kind == "full" else 0
        recent = first + min(held - first, settings.residual)
        per_head = fmt.stored_bytes(held - recent, group.head_dim, group_size, head_dims)
        per_head += residual_bytes(recent, group.head_dim)
        layer_heads = group.num_layers * group.num_kv_heads
        kinds.append(
            LayerKindPlan(
                kind=group.kind,
                window=group.window,
                num_layers=group.num_layers,
                num_kv_heads=group.num_kv_heads,
                head_dim=group.head_dim,
                bound=bound,
                tokens_held=held,
                tokens_full_precision=recent,
                kv_bytes=batch * layer_heads * per_head,
                bytes_per_token=layer_heads * fmt.bytes_per_token(group.head_dim, group_size, head_dims),
            )
        )
    kv_bytes = sum(k.kv_bytes for k in kinds)
    per_token = sum(k.bytes_per_token for k in kinds)
    fp16_per_token = sum(
        g.num_layers * g.num_kv_heads * fp16.bytes_per_token(g.head_dim, 1) for g in model.groups
    )
    return Plan(
        model=model.name,
        model_type=model.model_type,
        kv_format=fmt.name,
        context=context,
        batch=batch,
        group_size=group_size,
        residual=settings.residual,
        first_tokens=settings.first_tokens,
        budget=settings.budget,
        weights_dtype=settings.weights_dtype,
        num_parameters=model.parameters.total,
        weights_bytes=_weights_bytes(model, settings),
        kv_bytes=kv_bytes,
        kv_bytes_per_token=kv_bytes / (batch * context) if context else 0.0,
        kv_bytes_per_token_excl_residual=per_token,
        kv_bytes_per_token_asymptotic=sum(k.bytes_per_token for k in kinds if k.bound is None),
        ratio_to_fp16=per_token / fp16_per_token,
        layer_kinds=tuple(kinds),
        max_position_embeddings=model.max_position_embeddings,
        tp=model.tp,
    )


def plan(
    config: str | PreTrainedConfig,
    context: int,
    batch: int = 1,
    kv_format: str = "fp16",
    group_size: int | None = None,
    residual: int = DEFAULT_RESIDUAL,
    budget: int | None = None,
    weights_dtype: str = "bf16",
    tp: int = 1,
    first_tokens: int | None = None,
) -> Plan:
    """Weights + KV bytes of `config` holding `context` tokens for each of `batch` sequences.

    `config`: a config object, a shipped short name (``"llama-3.1-8b"``), a path to a config.json or its
    folder, or a hub id. `kv_format`: fp32, fp16, bf16, fp8, int8, int4, int2, or a rotated ``"k<X>v<Y>"``
    (X-bit keys, Y-bit values, each 1, 2, 3, 4 or 8: k4v4, k4v2, k3v2, k2v2, ...). `residual` (full-precision
    recent window, default 128 tokens) applies to the quantized formats (KIVI int8/int4/int2/fp8 and rotated, as
    `QuantizedCache` stores them); `group_size` to the KIVI ones only (the others have no groups and ignore
    it); `group_size=None` is the cache's default,
    ``gcd(DEFAULT_GROUP_SIZE[format], *head_dims)`` (int8 64, int4/int2/fp8 32). `budget`:
    tokens an evicting cache keeps per layer (sinks + recent), None for no eviction. `weights_dtype`:
    fp32, fp16, bf16, fp8, int8, int4 (nominal bits per weight, no quantization scales). `tp`: tensor-parallel
    ranks; the plan is then one rank's (see `Plan`). `first_tokens`: exact first tokens of each row of the
    full-attention layers of a quantized format; None: the preset's, as `QuantizedCache` keeps them (4 for k4v2,
    k3v2 and k2v2; 0 for the others and with a `budget`).
    """
    _check_context(context)
    _check_batch(batch)
    model = _model(config, tp)
    settings = _settings(model, kv_format, group_size, residual, budget, weights_dtype, first_tokens)
    return _evaluate(model, settings, context, batch)


def _free_for_kv(model: _Model, settings: _Settings, memory: int) -> int:
    weights = _weights_bytes(model, settings)
    if weights > memory:
        raise CapacityError(
            f"the weights alone need {format_bytes(weights)} ({weights:,} bytes: "
            f"{model.parameters.total:,} parameters in {settings.weights_dtype}), more than the "
            f"{format_bytes(memory)} ({memory:,} bytes) given"
        )
    return memory - weights


def max_context(
    config: str | PreTrainedConfig,
    memory: int | str,
    batch: int = 1,
    kv_format: str = "fp16",
    group_size: int | None = None,
    residual: int = DEFAULT_RESIDUAL,
    budget: int | None = None,
    weights_dtype: str = "bf16",
    tp: int = 1,
    first_tokens: int | None = None,
) -> int | None:
    """The largest context whose plan (weights + KV, `batch` sequences) fits in `memory`.

    `memory`: bytes, or a string such as "24GB" (decimal) or "24GiB" (binary). Returns None when every
    context fits: all KV layers are bounded by sliding windows or the eviction budget and the saturated
    cache fits. Returns 0 when the weights fit but not one token more. Raises `CapacityError` when the
    weights alone do not fit. The result is not capped at the model's `max_position_embeddings`. With `tp`
    ranks, `memory` is one rank's.
    """
    _check_batch(batch)
    model = _model(config, tp)
    settings = _settings(model, kv_format, group_size, residual, budget, weights_dtype, first_tokens)
    memory = parse_memory(memory)
    _free_for_kv(model, settings, memory)

    def fits(context: int) -> bool:
        return _evaluate(model, settings, context, batch).total_bytes <= memory

    bounds = [_bound(g, settings.budget) for g in model.groups]
    if all(b is not None for b in bounds):
        saturated = max(bounds)  # KV bytes stop growing here
        if fits(saturated):
            return None
        high = saturated
    else:
        high = 1
        while fits(high):  # KV bytes grow at least one byte per token: this ends
            high *= 2
    low = 0  # fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def max_batch(
    config: str | PreTrainedConfig,
    memory: int | str,
    context: int,
    kv_format: str = "fp16",
    group_size: int | None = None,
    residual: int = DEFAULT_RESIDUAL,
    budget: int | None = None,
    weights_dtype: str = "bf16",
    tp: int = 1,
    first_tokens: int | None = None,
) -> int:
    """The largest number of sequences of `context` tokens whose plan fits in `memory` (0 if none).

    KV bytes are exactly proportional to the batch, so this is ``(memory - weights) // kv_bytes(batch=1)``.
    Raises `CapacityError` when the weights alone do not fit. With `tp` ranks, `memory` is one rank's.
    """
    _check_context(context)
    if context < 1:
        raise ConfigError(f"max_batch needs a context of at least 1 token, got context={context}")
    model = _model(config, tp)
    settings = _settings(model, kv_format, group_size, residual, budget, weights_dtype, first_tokens)
    memory = parse_memory(memory)
    free = _free_for_kv(model, settings, memory)
    return free // _evaluate(model, settings, context, 1).kv_bytes
