"""KVzapCache: KVzip's query-agnostic eviction at the cost of a prefill, by a surrogate that predicts its scores.

>>> cache = KVzapCache(model.config, budget=0.2)     # the surrogate fitted on this model, found from its config
>>> model.generate(**inputs, cache=cache, max_new_tokens=20)   # the prompt scored as it comes, a fifth of it kept
>>> KVzapCache(model.config, "my/surrogate.safetensors", budget=820)   # a surrogate file of your own, 820 per head

The surrogate (`Surrogate`, fitted by `kvplus train-surrogate` on KVzip's scores of other texts) scores every token
from its key and value as it arrives (`eviction.KVzapPolicy`), so no second forward is needed and it works inside
`generate()`, decode steps included. Without a path the cache takes the model's own (`fitted.surrogate_for`: the user
cache folder, then the package data, which holds SmolLM2-135M's and Gemma 3 270M's); a model with none gets
`ArtifactNotFoundError`, which says how to make one and what it costs.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path

from transformers import PreTrainedConfig

from .errors import ConfigError
from .evicting_cache import PROVISIONAL, EvictingCache, _check_first_fits
from .eviction.budget import check_budget
from .eviction.kvzap import KVzapPolicy
from .eviction.rope import RotaryShift
from .fitted import surrogate_for
from .placement.base import Placement
from .surrogate import Surrogate

#: How the layers share the budget: by the surrogate's record of KVzip's global shares, or each its own.
BUDGETS = ("global", "uniform")


class KVzapCache(EvictingCache):
    """KVzap: per KV head, the `budget` tokens with the highest log KVzip score a `surrogate` (a `Surrogate`, the
    path of its file, or None: this model's, found from the config by `fitted.surrogate_for`) predicts from their keys
    and values, the first `sinks` positions and the `recent` newest first. The surrogate must have been fitted on this
    model (`Surrogate.check` refuses another with `CacheMismatchError`). `budget` is tokens, or a share of the prompt
    (`budget=0.2`: a fifth, sized at the prompt; `EvictingCache`). Sliding-window layers (Gemma 3) keep their window.

    `budgets="global"` (default, as KVzip) makes `budget` the mean over layers: each prompt gives a layer its share
    of `budget x layers` that KVzip's scores gave it on the surrogate's training texts (`Surrogate.shares`), at the
    kept fraction budget / held; `"uniform"` keeps `budget` in every layer.

    `compress="prefill"` (default) compresses prompts only and lets decode steps append, as kvpress does (the budget
    bounds what a prompt leaves); `"always"` evicts after every forward (a bounded cache). Sliding-window layers keep
    their own window. Assisted decoding is refused (its verification forwards would compress).
    """

    rollback = False

    def __init__(
        self,
        config: PreTrainedConfig,
        surrogate: Surrogate | str | Path | None = None,
        *,
        budget: int | float = 1024,
        sinks: int = 4,
        recent: int = 0,
        bits: int | str | None = None,
        group_size: int | None = None,
        placement: Placement | None = None,
        compress: str = "prefill",
        budgets: str = "global",
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
    ):
        if budgets not in BUDGETS:
            raise ConfigError(f"budgets must be one of {BUDGETS}, got {budgets!r}")
        if surrogate is None:
            surrogate = surrogate_for(config)
        elif not isinstance(surrogate, Surrogate):
            surrogate = Surrogate.load(surrogate)
        surrogate.check(config)
        #: The surrogate whose predictions rank the tokens.
        self.surrogate = surrogate
        rotary = RotaryShift.from_config(config)

        policy = partial(_policy, surrogate=surrogate, rotary=rotary, sinks=sinks, recent=recent, compress=compress,
                         budgets=budgets, first_tokens=first_tokens)  # fmt: skip
        policy(None, budget if isinstance(check_budget(budget), int) else PROVISIONAL)  # refuse bad sizes first
        super().__init__(
            config, policy, budget=budget, bits=bits, group_size=group_size, placement=placement,
            first_tokens=first_tokens, boundary_layers=boundary_layers, boundary_bits=boundary_bits,
            layer_bits=layer_bits,
        )  # fmt: skip


def _policy(spec, tokens: int, *, surrogate: Surrogate, rotary: RotaryShift, sinks: int, recent: int, compress: str,
            budgets: str, first_tokens) -> KVzapPolicy:  # fmt: skip
    """A KVzapCache layer's policy for a budget of `tokens` (spec None: the sizes checked on layer 0's weights); a
    module function: a cache keeps it, and pickles it."""
    index = 0 if spec is None else spec.index
    shares = surrogate.shares[:, index] if budgets == "global" and spec is not None else None
    made = KVzapPolicy(tokens, surrogate.weights[index], rotary, sinks, recent, compress, shares)
    _check_first_fits(first_tokens, tokens - recent, f"budget - recent = {tokens} - {recent}", "ranked tokens")
    return made
