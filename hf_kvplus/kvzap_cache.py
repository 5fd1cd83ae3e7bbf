"""KVzapCache: KVzip's query-agnostic eviction at the cost of a prefill, by a surrogate that predicts its scores.

>>> cache = KVzapCache(model.config, "eval/results/kvzap/smollm2-135m.safetensors", budget=820)
>>> model.generate(**inputs, cache=cache, max_new_tokens=20)   # the prompt scored as it comes, evicted to 820 per head

The surrogate (`Surrogate`, fitted by `kvplus train-surrogate` on KVzip's scores of other texts) scores every token
from its key and value as it arrives (`eviction.KVzapPolicy`), so no second forward is needed and it works inside
`generate()`, decode steps included.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from transformers import PreTrainedConfig

from .errors import ConfigError
from .evicting_cache import EvictingCache, _check_first_fits
from .eviction.kvzap import KVzapPolicy
from .eviction.rope import RotaryShift
from .placement.base import Placement
from .surrogate import Surrogate

#: How the layers share the budget: by the surrogate's record of KVzip's global shares, or each its own.
BUDGETS = ("global", "uniform")


class KVzapCache(EvictingCache):
    """KVzap: per KV head, the `budget` tokens with the highest log KVzip score a `surrogate` (a `Surrogate` or the
    path of its file) predicts from their keys and values, the first `sinks` positions and the `recent` newest
    first. The surrogate must have been fitted on this model (`Surrogate.check` refuses another).

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
        surrogate: Surrogate | str | Path,
        *,
        budget: int = 1024,
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
        surrogate = surrogate if isinstance(surrogate, Surrogate) else Surrogate.load(surrogate)
        surrogate.check(config)
        #: The surrogate whose predictions rank the tokens.
        self.surrogate = surrogate
        rotary = RotaryShift.from_config(config)

        def policy(spec) -> KVzapPolicy:
            shares = surrogate.shares[:, spec.index] if budgets == "global" else None
            return KVzapPolicy(budget, surrogate.weights[spec.index], rotary, sinks, recent, compress, shares)

        KVzapPolicy(budget, surrogate.weights[0], rotary, sinks, recent, compress)  # refuse bad sizes first
        _check_first_fits(first_tokens, budget - recent, f"budget - recent = {budget} - {recent}", "ranked tokens")
        super().__init__(
            config, policy, bits=bits, group_size=group_size, placement=placement, first_tokens=first_tokens,
            boundary_layers=boundary_layers, boundary_bits=boundary_bits, layer_bits=layer_bits,
        )  # fmt: skip
