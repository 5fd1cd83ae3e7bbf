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

from pathlib import Path

from transformers import PreTrainedConfig

from .evicting_cache import EvictingCache
from .eviction.kvzap import KVzapPolicy
from .fitted import surrogate_for
from .surrogate import Surrogate


class KVzapCache(EvictingCache, policy=KVzapPolicy):
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

    def __init__(self, config: PreTrainedConfig, surrogate: Surrogate | str | Path | None = None, **options):
        if surrogate is None:
            surrogate = surrogate_for(config)
        elif not isinstance(surrogate, Surrogate):
            surrogate = Surrogate.load(surrogate)
        #: The surrogate whose predictions rank the tokens.
        self.surrogate = surrogate
        super().__init__(config, surrogate=surrogate, **options)
