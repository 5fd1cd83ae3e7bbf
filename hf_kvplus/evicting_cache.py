"""Evicting caches: memory bounded by a token budget per layer, whatever the sequence length.

Full-attention layers keep `budget` tokens per KV head, chosen by a policy (StreamingLLM sinks +
window, H2O heavy hitters, SnapKV prompt selection); sliding-window layers keep their own window as
in every other cache. Evicting layers attend through hf_kvplus's attention path, which masks their
slots and reports attention mass, so the model must run "sdpa" (the default) or "kvplus" attention.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager

from transformers import PreTrainedConfig

from .attention.dispatch import FUSED_ATTENTION
from .cache import KVCache, model_retention
from .errors import ConfigError, UnsupportedModelError, UnsupportedOperationError
from .eviction.heavy_hitters import HeavyHitterPolicy
from .eviction.peak import PeakAttentionPolicy
from .eviction.policy import EvictionPolicy
from .eviction.rope import RotaryShift
from .eviction.sinks import POSITIONS, SinkPolicy
from .eviction.snapkv import SnapKVPolicy
from .formats import is_rotated, resolve_format
from .model_spec import LayerSpec, ModelSpec
from .placement.base import Placement
from .precision import PrecisionRegions, precision_report
from .storage.dense import DenseStorage
from .storage.slots import DenseCodec, SlotStore, TokenQuantCodec


class EvictingCache(KVCache):
    """A cache whose full-attention layers hold `SlotStore`s under a scored retention built by `policy(spec)`.

    `bits` (8, 4, 2 or "fp8") holds the kept tokens of the evicting layers quantized per token over
    groups of `group_size` channels (the quantized caches' defaults); None keeps them at full
    precision. Sliding-window layers keep their own window at full precision either way.
    `placement` (e.g. `Offloaded()`) says where every layer's tokens rest; on the device by default.

    Precision regions (`PrecisionRegions`, as `QuantizedCache`'s), with `bits`: `first_tokens` keeps the first tokens of
    each row (positions 0 .. first_tokens - 1; with left padding, a padded row's first positions are its padding)
    exact beside their slots' codes, and no policy evicts them (they rank with the recent window, so they take room in
    the budget: each cache checks they fit); `boundary_layers` holds the first and last that many layers' slots at full
    precision, or at `boundary_bits`; `layer_bits` (`{layer index: bits}`, None: full precision) gives any layer a
    format of its own (what `kvplus calibrate` chose; spec `calibration=PATH`). `quantized_report()` counts them.

    `compileable=True` (SinkCache, H2OCache: their budget holds every decode step's shape once full)
    declares `is_compileable`, so `generate()` compiles the decode forward as it does StaticCache's:
    on CUDA by default, on CPU with `CompileConfig._compile_all_devices`. It is opt-in because
    Transformers then builds a full decode mask every step, even where no row is padded, which sends
    an eager step down the padded path: about a quarter more ops per layer.
    """

    #: Whether assisted decoding may roll tokens back; refused for the whole cache when not, even on a
    #: model whose layers are all sliding (the same cache must behave the same on every model).
    rollback: bool = True
    #: Whether its policy ranks by accumulated attention, so slots keep a `score` each (StreamingLLM's does not).
    keeps_scores: bool = True
    #: Whether its slots count the tokens a mask hid (`SlotStore.hidden`: StreamingLLM's sinks move by the evicted
    #: tokens only).
    counts_hidden: bool = False

    def __init__(
        self,
        config: PreTrainedConfig,
        policy: Callable[[LayerSpec], EvictionPolicy],
        *,
        bits: int | str | None = None,
        group_size: int | None = None,
        placement: Placement | None = None,
        compileable: bool = False,
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
    ):
        implementation = getattr(config, "_attn_implementation", None)
        if implementation is not None and implementation not in FUSED_ATTENTION:
            raise UnsupportedModelError(
                f"{type(self).__name__} attends through hf_kvplus's attention, but the model uses "
                f"attn_implementation={implementation!r}; load it with 'sdpa' (the default) or 'kvplus'"
            )
        model = ModelSpec.from_config(config)
        fmt = resolve_format(model, bits, group_size)
        #: The exact regions (no window: every kept token past the first ones is coded).
        self.regions = regions = PrecisionRegions(0, first_tokens, boundary_layers, boundary_bits, layer_bits or {})
        regions.check_layers(model.num_layers)
        if fmt is None and (first_tokens or regions.overrides()):
            raise ConfigError(
                f"first_tokens={first_tokens}, boundary_layers={boundary_layers} and layer_bits={layer_bits} need bits: "
                "slots at full precision are exact everywhere"
            )
        formats = {bits: fmt}  # by bits (a layer's own grouped format takes the cache's `group_size`)
        for own in set(regions.own_bits(model.num_layers).values()) - {bits}:
            grouped = own is not None and not is_rotated(own)
            formats[own] = resolve_format(model, own, group_size if grouped else None)
        self.format = fmt

        def storage(spec: LayerSpec) -> SlotStore | DenseStorage:
            if spec.kind != "full":
                return DenseStorage()
            layer_fmt = formats[regions.bits_of(spec.index, model.num_layers, bits)]
            codec = DenseCodec() if layer_fmt is None else TokenQuantCodec(layer_fmt.for_layer(spec.index))
            return SlotStore(codec, scores=self.keeps_scores, device_count=compileable, first=first_tokens,
                             count_hidden=self.counts_hidden)  # fmt: skip

        def retention(spec: LayerSpec) -> EvictionPolicy:
            return policy(spec) if spec.kind == "full" else model_retention(spec)

        super().__init__(config, storage=storage, retention=retention, placement=placement, compileable=compileable)

    def quantized_report(self) -> dict:
        """As `QuantizedCache.quantized_report`: bytes at rest of the coded tokens (codes, scales and zero points), per
        token and as a fraction of float16 K/V for the same tokens; and `bits_per_coordinate` over every held token
        (there is no full-precision window), the first-tokens region, full-precision boundary layers and sliding layers
        included at their dtype's bits. (The region's slots also hold codes, which attention does not read:
        `memory_report` counts them, these figures do not.)"""
        if self.format is None:
            raise UnsupportedOperationError(f"quantized_report needs a quantized {type(self).__name__} (built with bits=...)")
        return precision_report(self, str(self.format), 0)

    @contextmanager
    def appending(self):
        """Within it, no forward evicts: tokens append past the budget, and the policies keep observing. kvpress's
        pipeline works so (the context compressed at its prefill, the question and the answer appended), and so does
        a query-agnostic evaluation (`needle_grid(..., mode="agnostic")`). A compileable cache refuses (its slots
        are fixed)."""
        if self.is_compileable:
            raise UnsupportedOperationError(
                f"{type(self).__name__}(compileable=True) holds budget + 1 slots per head: it cannot append past its "
                "budget"
            )
        policies = [layer.retention for layer in self.layers if isinstance(getattr(layer, "retention", None),
                                                                           EvictionPolicy)]  # fmt: skip
        for policy in policies:
            policy.paused = True
        try:
            yield self
        finally:
            for policy in policies:
                policy.paused = False

    def activate_past_recording(self) -> None:
        if not self.rollback:
            raise UnsupportedOperationError(
                f"{type(self).__name__} cannot roll tokens back (its scores already count the rejected queries); "
                "assisted and prompt-lookup decoding need a croppable cache such as SinkCache"
            )
        super().activate_past_recording()


def _check_first_fits(first_tokens, room: int, what: str, ranked: str) -> None:
    """The first-tokens region is never evicted, so it takes room that the policy's ranked tokens would have."""
    if isinstance(first_tokens, int) and not isinstance(first_tokens, bool) and first_tokens > room:
        raise ConfigError(
            f"first_tokens={first_tokens} does not fit: the region is never evicted and takes the room of the "
            f"{ranked}, {what} = {room} slots per head; give first_tokens <= {room}"
        )


def _check_compileable(compress: str, compileable: bool) -> None:
    if compileable and compress != "always":
        raise ConfigError(
            f"compileable=True needs compress='always': with compress={compress!r} decode steps append, so their "
            "shapes grow and generate() could not compile them"
        )


class SinkCache(EvictingCache):
    """StreamingLLM: `num_sinks` first tokens of each row plus the `window` most recent ones.

    `positions="cache"` (default) counts positions inside the cache, which keeps perplexity stable
    far past the model's trained length; `positions="original"` keeps each key where the model put
    it. Supports greedy, sampling, beam search and assisted decoding.

    >>> cache = SinkCache(model.config, num_sinks=4, window=1020)  # bits=4: the kept tokens in int4
    >>> model.generate(**inputs, cache=cache, max_new_tokens=100_000)

    `compress="prefill"` compresses only after multi-token forwards (each prompt), as kvpress's presses do,
    and lets decode steps append: the budget then bounds what a prompt leaves, not the cache.
    """

    keeps_scores = False  # it evicts by position
    counts_hidden = True

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        num_sinks: int = 4,
        window: int = 1020,
        positions: str = "cache",
        bits: int | str | None = None,
        group_size: int | None = None,
        placement: Placement | None = None,
        compileable: bool = False,
        compress: str = "always",
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
    ):
        if positions not in POSITIONS:
            raise ConfigError(f"positions must be one of {POSITIONS}, got {positions!r}")
        rotary = RotaryShift.from_config(config) if positions == "cache" and num_sinks else None
        SinkPolicy(num_sinks, window, rotary, compress)  # refuse bad sizes before building layers
        if isinstance(first_tokens, int) and first_tokens > num_sinks:
            raise ConfigError(
                f"first_tokens={first_tokens} exceeds num_sinks={num_sinks}: a SinkCache keeps the first {num_sinks} "
                "tokens of each row (and moves only those when positions='cache'); give first_tokens <= num_sinks"
            )
        _check_compileable(compress, compileable)
        super().__init__(
            config, lambda spec: SinkPolicy(num_sinks, window, rotary, compress), bits=bits, group_size=group_size,
            placement=placement, compileable=compileable, first_tokens=first_tokens, boundary_layers=boundary_layers,
            boundary_bits=boundary_bits, layer_bits=layer_bits,
        )


class H2OCache(EvictingCache):
    """H2O: per KV head, `budget - recent` heavy hitters (largest accumulated attention) + `recent` newest.

    `recent` defaults to half the budget, as in the paper. Keys keep their original positions.
    Supports greedy, sampling and beam search; assisted decoding is refused (a rolled-back query
    would already have added its attention to the scores). `compress="prefill"` as for SinkCache.
    """

    rollback = False

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        budget: int = 1024,
        recent: int | None = None,
        bits: int | str | None = None,
        group_size: int | None = None,
        placement: Placement | None = None,
        compileable: bool = False,
        compress: str = "always",
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
    ):
        recent = budget // 2 if recent is None else recent
        HeavyHitterPolicy(budget, recent, compress)
        _check_compileable(compress, compileable)
        _check_first_fits(first_tokens, budget - recent, f"budget - recent = {budget} - {recent}", "heavy hitters")
        super().__init__(
            config, lambda spec: HeavyHitterPolicy(budget, recent, compress), bits=bits, group_size=group_size,
            placement=placement, compileable=compileable, first_tokens=first_tokens, boundary_layers=boundary_layers,
            boundary_bits=boundary_bits, layer_bits=layer_bits,
        )


class SnapKVCache(EvictingCache):
    """SnapKV: each prompt (multi-token forward) is compressed to `budget` tokens per KV head.

    The last `observation` prompt tokens are kept; the rest are ranked by the attention those tokens
    give them, pooled over `kernel_size` neighbours. Decode steps append. Supports greedy, sampling
    and beam search; assisted decoding is refused (its verification forwards would compress).
    """

    rollback = False

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        budget: int = 1024,
        observation: int = 32,
        kernel_size: int = 7,
        pooling: str = "avg",
        bits: int | str | None = None,
        group_size: int | None = None,
        placement: Placement | None = None,
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
    ):
        SnapKVPolicy(budget, observation, kernel_size, pooling)
        _check_first_fits(first_tokens, budget - observation, f"budget - observation = {budget} - {observation}",
                          "selected tokens")  # fmt: skip
        policy = lambda spec: SnapKVPolicy(budget, observation, kernel_size, pooling)  # noqa: E731
        super().__init__(
            config, policy, bits=bits, group_size=group_size, placement=placement, first_tokens=first_tokens,
            boundary_layers=boundary_layers, boundary_bits=boundary_bits, layer_bits=layer_bits,
        )


class PeakCache(EvictingCache):
    """Peak attention (`PeakAttentionPolicy`, KVzip's query-agnostic score in one pass): per KV head, the `recent`
    newest tokens plus `budget - recent` with the largest attention any single query gave them.

    `recent` defaults to an eighth of the budget; `kernel_size` max-pools a prompt's scores over neighbouring tokens.
    `compress="prefill"` as for SinkCache: compress prompts only, so that a context compressed before its question
    (kvpress's pipeline, `appending()`) keeps what its own tokens read. Assisted decoding is refused, as for H2O.
    """

    rollback = False

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        budget: int = 1024,
        recent: int | None = None,
        kernel_size: int = 1,
        bits: int | str | None = None,
        group_size: int | None = None,
        placement: Placement | None = None,
        compress: str = "always",
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
    ):
        recent = budget // 8 if recent is None else recent
        PeakAttentionPolicy(budget, recent, kernel_size, compress)
        _check_first_fits(first_tokens, budget - recent, f"budget - recent = {budget} - {recent}", "ranked tokens")
        super().__init__(
            config, lambda spec: PeakAttentionPolicy(budget, recent, kernel_size, compress), bits=bits,
            group_size=group_size, placement=placement, first_tokens=first_tokens, boundary_layers=boundary_layers,
            boundary_bits=boundary_bits, layer_bits=layer_bits,
        )
