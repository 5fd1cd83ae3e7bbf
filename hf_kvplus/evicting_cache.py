"""Evicting caches: memory bounded by a token budget per layer, whatever the sequence length.

Full-attention layers keep `budget` tokens per KV head, chosen by an eviction policy (`eviction`: any class that
declares its settings and `score()`, registered under a spec name); sliding-window layers keep their own window as
in every other cache. Evicting layers attend through hf_kvplus's attention path, which masks their slots and reports
attention mass, so the model must run "sdpa" (the default) or "kvplus" attention. The named caches (`SinkCache`,
`H2OCache`, ...) are `EvictingCache` with their policy fixed.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import ClassVar

from transformers import PreTrainedConfig

from .attention.dispatch import FUSED_ATTENTION
from .cache import KVCache, model_retention
from .errors import ConfigError, UnsupportedModelError, UnsupportedOperationError
from .eviction.budget import check_budget, prompt_share
from .eviction.declare import Setting, policy_class
from .eviction.heavy_hitters import HeavyHitterPolicy
from .eviction.peak import PeakAttentionPolicy
from .eviction.policy import EvictionPolicy
from .eviction.sinks import SinkPolicy
from .eviction.snapkv import SnapKVPolicy
from .fitted import key_scale_for
from .formats import any_rotated, is_rotated, layer_state, resolve_format
from .key_scale import KeyScale
from .model_spec import LayerSpec, ModelSpec
from .placement.base import Placement
from .precision import PrecisionRegions, precision_report
from .storage.dense import DenseStorage
from .storage.slots import DenseCodec, SlotStore, TokenQuantCodec

#: The budget the layers of a cache with a fractional budget are built with until its prompt gives the count: larger
#: than any prompt, so that building them checks every size but the budget's own.
PROVISIONAL = 1 << 30
#: The budget of a cache given a policy class and no budget.
DEFAULT_BUDGET = 1024


class EvictingCache(KVCache):
    """A cache whose full-attention layers hold `SlotStore`s, each ranked by its own instance of an eviction `policy`:
    a policy class (`EvictionPolicy` subclass) or its registered spec name, built per layer with the keyword
    `settings` it declares (checked against their bounds; `ConfigError` names the option, the value and the bounds);
    an instance (copied per layer; no settings); or a function `policy(spec, tokens)` (`policy(spec)` without a
    budget) that builds one.

    >>> EvictingCache(config, policy="h2o", budget=256, recent=32, bits="int4")

    `budget` (`eviction.budget`): an int is the tokens each policy keeps; a float in (0, 1] the share of the prompt,
    which the cache's first forward turns into tokens (int(budget x its tokens per row, padding included), at least 1,
    the same for every row: kvpress's count), before any layer changes; the policies are then built with that count
    (`budget_tokens`), and a count they refuse (fewer tokens than the sinks, the recent window or the observation
    window need) raises `ConfigError` naming the share, the prompt and the count, leaving the cache unchanged.
    `reset()` makes it a share again.

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
    `key_scale` ("auto"): a rotated format's keys coded times the model's fitted per-pair scale, as `QuantizedCache`'s
    ("auto": the model's own where one ships, "off" or None: none, or a `KeyScale` or its path; spec
    `key_scale=auto|off|PATH`); `quantized_report()["key_scale"]` names its model.

    `compileable=True` (a policy that declares `compileable`, with compress='always': sinks, H2O; its budget holds
    every decode step's shape once full)
    declares `is_compileable`, so `generate()` compiles the decode forward as it does StaticCache's:
    on CUDA by default, on CPU with `CompileConfig._compile_all_devices`. It is opt-in because
    Transformers then builds a full decode mask every step, even where no row is padded, which sends
    an eager step down the padded path: about a quarter more ops per layer.
    """

    #: The policy of a named cache (set by `policy=` in its class statement).
    policy: ClassVar[type[EvictionPolicy] | None] = None
    #: Settings of the cache itself beyond its policy's (set as attributes).
    settings: ClassVar[tuple[Setting, ...]] = ()
    #: Whether assisted decoding may roll tokens back (the policy's `is_croppable`); refused for the whole cache when
    #: not, even on a model whose layers are all sliding (the same cache must behave the same on every model).
    rollback: bool = True

    def __init_subclass__(cls, policy: type[EvictionPolicy] | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if policy is not None:
            cls.policy = policy
        if cls.policy is not None:  # what `help()` and editors show: every keyword, the policy's settings included
            cls.__signature__ = _signature(cls)

    def __init__(
        self,
        config: PreTrainedConfig,
        policy: type[EvictionPolicy] | EvictionPolicy | str | Callable[..., EvictionPolicy] | None = None,
        *,
        budget: int | float | None = None,
        bits: int | str | None = None,
        group_size: int | None = None,
        placement: Placement | None = None,
        compileable: bool = False,
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
        key_scale: KeyScale | str | Path | None = "auto",
        **settings,
    ):
        implementation = getattr(config, "_attn_implementation", None)
        if implementation is not None and implementation not in FUSED_ATTENTION:
            raise UnsupportedModelError(
                f"{type(self).__name__} attends through hf_kvplus's attention, but the model uses "
                f"attn_implementation={implementation!r}; load it with 'sdpa' (the default) or 'kvplus'"
            )
        for setting in type(self).settings:
            setattr(self, setting.name, setting.check(settings.pop(setting.name, setting.default), type(self).__name__))
        policy, kind, budget = _policy_factory(config, type(self).policy if policy is None else policy, settings,
                                               budget, first_tokens, compileable)  # fmt: skip
        keeps_scores = counts_hidden = None
        if kind is not None:
            self.rollback, keeps_scores, counts_hidden = kind.is_croppable, kind.keeps_scores, kind.counts_hidden
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
        #: The keys' scale (`KeyScale`) where a rotated format codes them, or None.
        self.key_scale = key_scale_for(config, key_scale) if any_rotated(*formats) else None

        def storage(spec: LayerSpec) -> SlotStore | DenseStorage:
            if spec.kind != "full":
                return DenseStorage()
            layer_fmt = formats[regions.bits_of(spec.index, model.num_layers, bits)]
            codec = DenseCodec() if layer_fmt is None else TokenQuantCodec(
                layer_fmt.for_layer(spec.index), layer_state(layer_fmt, spec.index, self.key_scale))  # fmt: skip
            return SlotStore(codec, scores=keeps_scores is not False, device_count=compileable, first=first_tokens,
                             count_hidden=bool(counts_hidden))  # fmt: skip

        #: The budget as given: tokens, a share of the prompt, or None (`policy(spec)` sizes itself).
        self.budget = None if budget is None else check_budget(budget)
        #: The budget in tokens: `budget`, or what a share came to at the prompt (None until then).
        self.budget_tokens = budget if isinstance(budget, int) else None
        self._policy = policy if isinstance(budget, float) else None  # (what `size_budget` builds with)
        initial = PROVISIONAL if isinstance(budget, float) else budget
        if initial is not None:
            policy(None, initial)  # refuse bad sizes before building layers

        def retention(spec: LayerSpec) -> EvictionPolicy:
            if spec.kind != "full":
                return model_retention(spec)
            return policy(spec) if budget is None else policy(spec, initial)

        super().__init__(config, storage=storage, retention=retention, placement=placement, compileable=compileable)
        if isinstance(budget, float):
            self.update = self._sizing_update  # (an instance attribute until the prompt: no cost after it)

    def _sizing_update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """The first forward's first `update`: turns the share into tokens, then updates as always."""
        self.size_budget(key_states.shape[-2])
        return KVCache.update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def size_budget(self, prompt: int) -> int:
        """Builds the policies for `prompt_share(budget, prompt)` tokens (a fractional budget; the first forward calls
        it with its tokens per row) and returns the count. Raises `ConfigError` before changing anything when a policy
        refuses the count."""
        if not isinstance(self.budget, float):
            raise UnsupportedOperationError(f"size_budget sizes a share of the prompt; this cache's budget is "
                                            f"{self.budget!r}")  # fmt: skip
        tokens = prompt_share(self.budget, prompt)
        layers = [layer for layer in self.layers if isinstance(getattr(layer, "retention", None), EvictionPolicy)]
        try:
            policies = [self._policy(layer.spec, tokens) for layer in layers]
        except ConfigError as error:
            raise ConfigError(f"budget={self.budget} of a {prompt}-token prompt is int({self.budget} x {prompt}) = "
                              f"{tokens} tokens, too few: {error}") from None  # fmt: skip
        for layer, policy in zip(layers, policies, strict=True):
            layer.retention = policy
        self.budget_tokens = tokens
        self.__dict__.pop("update", None)
        return tokens

    def reset(self) -> None:
        super().reset()
        if isinstance(self.budget, float):  # sized again by the next prompt
            self.budget_tokens = None
            self.update = self._sizing_update

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("update", None)  # (a bound method: put back by `__setstate__`)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if isinstance(self.budget, float) and self.budget_tokens is None:
            self.update = self._sizing_update

    def quantized_report(self) -> dict:
        """As `QuantizedCache.quantized_report`: bytes at rest of the coded tokens (codes, scales and zero points), per
        token and as a fraction of float16 K/V for the same tokens; and `bits_per_coordinate` over every held token
        (there is no full-precision window), the first-tokens region, full-precision boundary layers and sliding layers
        included at their dtype's bits. (The region's slots also hold codes, which attention does not read:
        `memory_report` counts them, these figures do not.)"""
        if self.format is None:
            raise UnsupportedOperationError(f"quantized_report needs a quantized {type(self).__name__} (built with bits=...)")
        return precision_report(self, str(self.format), 0, self.key_scale)

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


def _signature(cls: type[EvictingCache]) -> inspect.Signature:
    """A named cache's keywords: its own, `EvictingCache`'s, then its policy's and its own declared settings."""
    own = [p for p in inspect.signature(cls.__init__).parameters.values()
           if p.name not in ("self", "policy") and p.kind is not p.VAR_KEYWORD]  # fmt: skip
    names = {p.name for p in own} | {"policy"}
    base = [p for p in inspect.signature(EvictingCache.__init__).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name not in names]  # fmt: skip
    declared = [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=s.default)
                for s in (*cls.policy.settings, *cls.settings) if s.name not in names]  # fmt: skip
    return inspect.Signature(own + base + declared)


def _policy_factory(config, policy, settings: dict, budget, first_tokens, compileable: bool):
    """(a function `policy(spec, tokens)` that builds a layer's policy, the policy's class or None when a function was
    given, the budget: `DEFAULT_BUDGET` for a class given none, an instance's own)."""
    if isinstance(policy, str):
        policy = policy_class(policy)
    if isinstance(policy, EvictionPolicy) or not isinstance(policy, type) and callable(policy):
        if settings:
            raise ConfigError(f"settings {sorted(settings)} are a policy class's; {policy!r} is built already: give "
                              "its class (or spec name) with them")  # fmt: skip
        if compileable and not (isinstance(policy, EvictionPolicy) and policy.compileable):
            raise ConfigError(f"compileable=True needs a policy whose shapes are fixed once full; {policy!r} is not")
        if not isinstance(policy, EvictionPolicy):
            return policy, None, budget
        if isinstance(budget, float) or budget not in (None, policy.budget):
            raise ConfigError(f"{policy!r} keeps budget={policy.budget}, got budget={budget}: give a policy class to "
                              "size it")  # fmt: skip
        policy.check_first(first_tokens)
        return partial(_copied, policy), type(policy), None
    if not (isinstance(policy, type) and issubclass(policy, EvictionPolicy)):
        raise ConfigError(f"policy is an EvictionPolicy class, instance or registered name, or a function "
                          f"(spec, tokens) -> policy; got {policy!r}")  # fmt: skip
    declared = {setting.name: setting for setting in policy.settings}
    unknown = set(settings) - set(declared)
    if unknown:
        raise ConfigError(f"{policy.__name__} takes no setting {sorted(unknown)}; it accepts {sorted(declared)}")
    options = {name: setting.check(settings.get(name, setting.default), policy.__name__)
               for name, setting in declared.items()}  # fmt: skip
    if compileable and not policy.compileable:
        raise ConfigError(f"{policy.__name__} cannot be compiled (compileable=True): its shapes change after the "
                          "prompt")  # fmt: skip
    if compileable and options.get("compress", "always") != "always":
        raise ConfigError(
            f"compileable=True needs compress='always': with compress={options['compress']!r} decode steps append, so "
            "their shapes grow and generate() could not compile them"
        )
    build = partial(_built, policy, policy.prepare(config, options), first_tokens)
    return build, policy, DEFAULT_BUDGET if budget is None else check_budget(budget)


# Module functions (a cache sized at its prompt keeps its factory, and pickles it).


def _built(cls: type[EvictionPolicy], options: dict, first_tokens, spec, tokens: int) -> EvictionPolicy:
    made = cls.for_layer(spec, tokens, options)
    made.check_first(first_tokens)
    return made


def _copied(policy: EvictionPolicy, spec) -> EvictionPolicy:
    return copy.deepcopy(policy)


class SinkCache(EvictingCache, policy=SinkPolicy):
    """StreamingLLM: `num_sinks` first tokens of each row plus the `window` most recent ones.

    `positions="cache"` (default) counts positions inside the cache, which keeps perplexity stable
    far past the model's trained length; `positions="original"` keeps each key where the model put
    it. Supports greedy, sampling, beam search and assisted decoding.

    >>> cache = SinkCache(model.config, num_sinks=4, window=1020)  # bits=4: the kept tokens in int4
    >>> model.generate(**inputs, cache=cache, max_new_tokens=100_000)
    >>> cache = SinkCache(model.config, budget=0.2)  # the sinks + a window: a fifth of the prompt (kvpress's 0.8)

    `budget` (tokens, or a share of the prompt: `EvictingCache`) sizes the sinks and the window together (window =
    budget - num_sinks), in place of `window`. The other keywords are `EvictingCache`'s and `SinkPolicy`'s settings
    (`positions`, `compress`).

    `compress="prefill"` compresses only after multi-token forwards (each prompt), as kvpress's presses do,
    and lets decode steps append: the budget then bounds what a prompt leaves, not the cache.

    With `bits`, the sinks stay exact (`first_tokens=None` is `num_sinks` there, 0 without bits; `first_tokens=0` codes
    them too): they take the most attention, so coding them costs the most quality, and exact they cost a few tokens'
    bytes; nor are they re-coded at every step as they move.
    """

    def __init__(self, config: PreTrainedConfig, *, num_sinks: int = 4, window: int | None = None,
                 budget: int | float | None = None, first_tokens: int | None = None, **options):  # fmt: skip
        if window is not None and budget is not None:
            raise ConfigError(f"give window={window} or budget={budget} (the sinks and the window together), not both")
        budget = num_sinks + (1020 if window is None else window) if budget is None else check_budget(budget)
        if first_tokens is None:
            first_tokens = num_sinks if options.get("bits") is not None else 0
        super().__init__(config, budget=budget, num_sinks=num_sinks, first_tokens=first_tokens, **options)


class H2OCache(EvictingCache, policy=HeavyHitterPolicy):
    """H2O: per KV head, `budget - recent` heavy hitters (largest accumulated attention) + `recent` newest.

    `recent` defaults to half the budget, as in the paper. Keys keep their original positions. `budget` is tokens, or
    a share of the prompt (`budget=0.2`: a fifth of it, sized at the prompt; `EvictingCache`).
    Supports greedy, sampling and beam search; assisted decoding is refused (a rolled-back query
    would already have added its attention to the scores). `compress="prefill"` as for SinkCache.
    """


class SnapKVCache(EvictingCache, policy=SnapKVPolicy):
    """SnapKV: each prompt (multi-token forward) is compressed to `budget` tokens per KV head.

    The last `observation` prompt tokens are kept; the rest are ranked by the attention those tokens
    give them, pooled over `kernel_size` neighbours. Decode steps append. Supports greedy, sampling
    and beam search; assisted decoding is refused (its verification forwards would compress). `budget` is tokens, or a
    share of the prompt (`budget=0.2`, sized at the prompt; `EvictingCache`).
    """


class PeakCache(EvictingCache, policy=PeakAttentionPolicy):
    """Peak attention (`PeakAttentionPolicy`, KVzip's query-agnostic score in one pass): per KV head, the `recent`
    newest tokens plus `budget - recent` with the largest attention any single query gave them.

    `recent` defaults to an eighth of the budget; `kernel_size` max-pools a prompt's scores over neighbouring tokens.
    `compress="prefill"` as for SinkCache: compress prompts only, so that a context compressed before its question
    (kvpress's pipeline, `appending()`) keeps what its own tokens read. Assisted decoding is refused, as for H2O.
    `budget` is tokens, or a share of the prompt (`budget=0.2`, sized at the prompt; `EvictingCache`).
    """
