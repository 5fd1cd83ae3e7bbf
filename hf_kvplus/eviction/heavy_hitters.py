"""H2O: per KV head, the tokens with the largest accumulated attention (heavy hitters) plus a recent window."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..storage.slots import SlotStore
from .declare import Mass, Needs, Setting, compress_setting
from .policy import EvictionPolicy, check_compress, padding_and_recent


class HeavyHitterPolicy(EvictionPolicy, name="h2o"):
    """Keeps `budget - recent` heavy hitters and the `recent` newest tokens of each KV head.

    A token's score is the attention mass every later query gave it (summed over the query heads of
    its KV head's group), including the queries of the forward that brought it in. `recent` None: half the budget.
    """

    settings = (Setting("recent", int, None, minimum=0), compress_setting("always"))
    needs = Needs(mass=Mass(queries=None, reduce="sum", join="add"))
    compileable = True
    ranked = ("heavy hitters", "recent")

    @classmethod
    def for_layer(cls, spec, tokens: int, options: dict) -> HeavyHitterPolicy:
        recent = options["recent"]
        return cls(tokens, tokens // 2 if recent is None else recent, options["compress"])

    def __init__(self, budget: int, recent: int, compress: str = "always"):
        self.compress = check_compress(compress)
        if budget < 1:
            raise ConfigError(f"the H2O budget must hold at least 1 token, got budget={budget}")
        if not 0 <= recent <= budget:
            raise ConfigError(f"the recent window must be within 0..budget={budget}, got recent={recent}")
        self.budget, self.recent = budget, recent

    def score(self, store: SlotStore) -> torch.Tensor:
        return padding_and_recent(store, self.recent, store.scores)

    def __repr__(self) -> str:
        compress = ", compress='prefill'" if self.compress == "prefill" else ""
        return f"HeavyHitterPolicy(budget={self.budget}, recent={self.recent}{compress})"
