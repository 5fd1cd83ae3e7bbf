"""The base of an eviction policy written as one `score()`: kvpress's presses are one line each, and so is a policy here.

>>> class KnormPolicy(ScoredPolicy, name="knorm"):        # registered: EvictingCache(config, "knorm", budget=256)
...     needs = Needs(keys=True, per_token=True)           # and spec strings "knorm:256", "knorm:20%:bits=int4"
...     def score(self, view):
...         return -view.keys.float().norm(dim=-1)

The base keeps the first `sinks` positions and the `recent` newest tokens, drops padding first, reads what `needs`
declares for `score` (a `SlotView`), and evicts at prompts only (`compress="prefill"`, kvpress's setting) or after
every forward (`"always"`: a bounded cache, compileable where the class says so).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..errors import ConfigError
from ..storage.slots import SlotStore
from .declare import Setting, compress_setting
from .policy import KEEP, EvictionPolicy, check_ranked_budget, padding_and_recent


class SlotView:
    """What a score reads, made on first use: `keys` and `values` `[batch, kv_heads, n, dim]` as attention reads them
    (decoded from quantized slots), `mass` `[batch, kv_heads, n]` (the attention mass `needs.mass` asked for, as the
    slots have joined it), `positions` `[batch, kv_heads, n]` (PAD for padding). With `fresh`, n is the tokens the
    last forward brought (a per-token score), else every held slot."""

    def __init__(self, store: SlotStore, fresh: bool = False):
        self.store, self.fresh = store, fresh
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def _pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None:
            self._kv = self.store.fresh_slots() if self.fresh else self.store.slots()
        return self._kv

    @property
    def keys(self) -> torch.Tensor:
        return self._pair()[0]

    @property
    def values(self) -> torch.Tensor:
        return self._pair()[1]

    @property
    def mass(self) -> torch.Tensor:
        return self.store.scores

    @property
    def positions(self) -> torch.Tensor:
        return self.store.fresh_positions() if self.fresh else self.store.positions


class ScoredPolicy(EvictionPolicy):
    """Keeps, per KV head, the first `sinks` positions, the `recent` newest tokens and the `budget - sinks - recent`
    that `score` ranks highest. Subclasses declare `needs` and `settings` (these three first) and write `score`."""

    settings = (Setting("sinks", int, 0, minimum=0), Setting("recent", int, 0, minimum=0), compress_setting("prefill"))

    def __init__(self, budget: int, **settings):
        declared = {setting.name: setting for setting in type(self).settings}
        unknown = set(settings) - set(declared)
        if unknown:
            raise ConfigError(f"{type(self).__name__} takes no setting {sorted(unknown)}; it accepts {sorted(declared)}")
        for name, setting in declared.items():
            setattr(self, name, setting.check(settings.get(name, setting.default), type(self).__name__))
        check_ranked_budget(type(self).__name__, budget, self.sinks, self.recent)
        if self.needs.per_token and self.needs.mass is not None:
            raise ConfigError(f"{type(self).__name__}: a per-token score reads the token alone, not attention mass")
        self.budget = budget

    @abstractmethod
    def score(self, view: SlotView) -> torch.Tensor:
        """`[batch, kv_heads, n]`: higher stays."""

    def evict(self, store: SlotStore, new: int, refill: bool) -> None:
        """A per-token score is taken once, as the tokens arrive; then eviction as every policy's."""
        if self.needs.per_token:
            store.write_fresh_scores(self.score(SlotView(store, fresh=True)).float())
        super().evict(store, new, refill)

    def ranks(self, store: SlotStore) -> torch.Tensor:
        scores = store.scores if self.needs.per_token else self.score(SlotView(store)).float()
        scores = scores.masked_fill(store.positions < self.sinks, KEEP) if self.sinks else scores
        return padding_and_recent(store, self.recent, scores)

    def __repr__(self) -> str:
        options = ", ".join(f"{s.name}={getattr(self, s.name)!r}" for s in type(self).settings)
        return f"{type(self).__name__}(budget={self.budget}, {options})"
