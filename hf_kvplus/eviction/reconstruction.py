"""Context reconstruction: KVzip's query-agnostic score (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression
with Context Reconstruction").

After a context is prefilled, a second forward asks the model to repeat it ("Repeat the previous context exactly."
followed by the context's tokens again) against the cache; a cached context token scores the largest attention weight
any query head of its KV head's group gave it from any repeating query. A token the repeat copies sharply (the digits
of a pass key) scores high even where no query of the context itself read it; the cache then keeps, per KV head, the
`budget` highest (the first `sinks` positions and the `recent` newest ranked first), and the repeat's own tokens are
dropped. This module is the scoring rule; the forward that feeds it needs the model (`kvzip_cache.reconstruct`).

What it drops against KVzip: the budget is the same for every KV head of a layer (KVzip ranks one top-k over heads and
layers; the slots keep one count per head, and `kvzip_cache.global_budgets` shares the budget among layers only), and
the repeat's queries attend over the whole cache (kvpress's KVzipPress scores each chunk against the sinks, that chunk
and its repeat only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..storage.slots import SlotStore
from .declare import Mass, Needs, Setting, compress_setting
from .policy import KEEP, EvictionPolicy, check_compress, check_ranked_budget, padding_and_recent


class ReconstructionPolicy(EvictionPolicy, name="kvzip"):
    """Keeps `budget` tokens per KV head, ranked by the peak attention of a context reconstruction.

    Nothing is evicted until a reconstruction has scored the slots (`reconstruct` sets `scoring` around its forwards
    and then evicts); before it the layer appends, so a context prefill keeps every token. Afterwards
    `compress="prefill"` (default) lets later forwards append (kvpress's pipeline: the question and the answer come
    after the compression); `"always"` evicts back to the budget after every forward, and as tokens that came after
    the reconstruction carry no score they leave as they leave the `recent` window (which must then hold one).
    `reduce="max_head"` takes the largest weight of one query head (KVzip); `"max"` the largest of the group's sum.
    """

    settings = (Setting("sinks", int, 4, minimum=0), Setting("recent", int, 0, minimum=0),
                Setting("kernel_size", int, 1, minimum=1, key="kernel"), compress_setting("prefill"),
                Setting("reduce", str, "max_head", choices=("max_head", "max")))  # fmt: skip
    needs = Needs(mass=Mass(queries=None, reduce="max_head", join="max"), reconstruction=True)

    def __init__(self, budget: int, sinks: int = 4, recent: int = 0, kernel_size: int = 1, compress: str = "prefill",
                 reduce: str = "max_head"):  # fmt: skip
        self.compress = check_compress(compress)
        check_ranked_budget("reconstruction", budget, sinks, recent)
        if compress == "always" and recent < 1:
            raise ConfigError("compress='always' needs recent >= 1: tokens after the reconstruction have no score, and "
                              "without a recent window each would be evicted right after its own step")  # fmt: skip
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be a positive odd number, got {kernel_size}")
        if reduce not in ("max_head", "max"):
            raise ConfigError(f"reduce must be 'max_head' or 'max', got {reduce!r}")
        self.budget, self.sinks, self.recent, self.kernel_size = budget, sinks, recent, kernel_size
        self.mass_reduce = reduce
        #: Set by `reconstruct` around its forwards: they report their attention and evict nothing.
        self.scoring = False
        #: Whether a reconstruction scored the slots (until then no forward evicts).
        self.scored_once = False
        self._evicting = False

    def mass_queries(self, new: int) -> int:
        return new if self.scoring else 0

    def observe(self, store: SlotStore, mass: torch.Tensor, new: int) -> None:
        if self.kernel_size > 1:  # a reconstruction leaves the context's slots in position order
            batch, heads, slots = mass.shape
            mass = F.max_pool1d(mass.reshape(batch * heads, 1, slots), self.kernel_size, stride=1,
                                padding=self.kernel_size // 2).view(batch, heads, slots)  # fmt: skip
        store.max_scores(mass)

    def excess(self, held: int, new: int) -> int:
        if self._evicting:
            return max(0, held - self.budget)
        if self.scoring or not self.scored_once or self.compress == "prefill":
            return 0
        return super().excess(held, new)

    def evict_scored(self, store: SlotStore, budget: int | None = None) -> None:
        """Evicts down to the budget by the scores a reconstruction left (`reconstruct`'s last step); `budget`, when
        given, becomes this layer's (a share of one budget over every layer: `reconstruct`'s `budgets="global"`)."""
        if budget is not None:
            if budget <= self.sinks + self.recent:
                raise ConfigError(
                    f"a layer's budget must exceed sinks + recent = {self.sinks + self.recent}, got {budget}"
                )
            self.budget = budget
        self.scored_once, self._evicting = True, True
        try:
            self.evict(store, store.length, refill=False)
        finally:
            self._evicting = False

    def score(self, store: SlotStore) -> torch.Tensor:
        ranks = store.scores.masked_fill(store.positions < self.sinks, KEEP) if self.sinks else store.scores
        return padding_and_recent(
            store, self.recent, ranks
        )  # (padding, at PAD < sinks, goes first all the same)

    def reset(self) -> None:
        self.scoring = self.scored_once = self._evicting = False

    def __repr__(self) -> str:
        options = [f"budget={self.budget}", f"sinks={self.sinks}", f"recent={self.recent}"]
        options += [f"kernel_size={self.kernel_size}"] if self.kernel_size > 1 else []
        options += [f"compress={self.compress!r}"] if self.compress != "prefill" else []
        options += [f"reduce={self.mass_reduce!r}"] if self.mass_reduce != "max_head" else []
        return f"ReconstructionPolicy({', '.join(options)})"
