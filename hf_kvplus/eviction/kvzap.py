"""KVzap (Jegou et al., 2026, "KVzap: Fast, Adaptive and Faithful KV Cache Pruning"): KVzip's query-agnostic scores
predicted from each token's own key and value by a fitted linear surrogate (`surrogate.Surrogate`).

KVzip (`reconstruction.ReconstructionPolicy`) needs a second forward that repeats the context; the surrogate reads
what the cache already holds, so a token is scored when it arrives, at prefill and at every decode step, inside
`generate()`, for the cost of one small matrix product per layer. A token's features are its key as cached, the same
key rotated back to position 0 (what the layer's projection made of its hidden state) and its value, read off the
slots the last forward wrote (decoded, on quantized slots); each KV head has its own weights. With `shares` (the
surrogate's record of KVzip's layer shares of one budget) each prompt sizes the layer's budget as KVzip's one top-k
over every layer would, from the kept fraction alone, so no layer waits for the others.
"""

from __future__ import annotations

import bisect

import torch

from ..errors import ShapeError
from ..storage.slots import SlotStore
from ..surrogate import KEEP_GRID
from .declare import Needs, Setting, compress_setting
from .policy import KEEP, EvictionPolicy, check_compress, check_ranked_budget, padding_and_recent
from .rope import RotaryShift

#: How the layers share the budget: by the surrogate's record of KVzip's global shares, or each its own.
BUDGETS = ("global", "uniform")


def kvzap_features(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   rotary: RotaryShift) -> torch.Tensor:  # fmt: skip
    """`[batch, kv_heads, n, 3 x head_dim]` float32: keys as cached, keys before RoPE, values (the "rope_kv"
    features), for keys and values `[batch, kv_heads, n, head_dim]` at `positions` `[batch, kv_heads, n]`."""
    return torch.cat((keys.float(), rotary.unturned(keys, positions), values.float()), dim=-1)


def predict(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[batch, kv_heads, n]` predicted log scores from `features` `[batch, kv_heads, n, f]` and one layer's
    `weights` `[kv_heads, f + 1]` (the last column the intercept)."""
    return torch.einsum("bhnf,hf->bhn", features, weights[:, :-1]) + weights[None, :, -1:]


class KVzapPolicy(EvictionPolicy, name="kvzap"):
    """Keeps `budget` tokens per KV head, ranked by a surrogate's predicted log KVzip score (`weights`
    `[kv_heads, 3 x head_dim + 1]`, one layer's), the first `sinks` positions and the `recent` newest first.

    Every forward's tokens are scored as they come, after attention. `compress="prefill"` (default) evicts after
    multi-token forwards only (kvpress's pipeline; decode steps append); `"always"` after every forward, decode steps
    included (a bounded cache), a new token competing with the kept ones on its own score.

    `shares` `[len(KEEP_GRID)]` (this layer's column of `Surrogate.shares`), when given, makes `budget` the mean over
    layers: each multi-token forward sets this layer's to `budget` x its share at the kept fraction budget / held
    (interpolated; at least sinks + recent + 1), and one-token steps keep it.

    As a cache's policy: `surrogate` (a `Surrogate` checked against the model) gives each layer its weights, and
    `budgets="global"` its shares.
    """

    settings = (Setting("surrogate", object, None, key="weights"), Setting("sinks", int, 4, minimum=0),
                Setting("recent", int, 0, minimum=0), compress_setting("prefill"),
                Setting("budgets", str, "global", choices=BUDGETS))  # fmt: skip
    needs = Needs(keys=True, per_token=True, surrogate=True)

    @classmethod
    def prepare(cls, config, options: dict) -> dict:
        options["surrogate"].check(config)
        return {**options, "rotary": RotaryShift.from_config(config)}

    @classmethod
    def for_layer(cls, spec, tokens: int, options: dict) -> KVzapPolicy:
        """Layer `spec.index`'s weights (spec None: the sizes checked on layer 0's)."""
        surrogate, index = options["surrogate"], 0 if spec is None else spec.index
        shares = surrogate.shares[:, index] if options["budgets"] == "global" and spec is not None else None
        return cls(tokens, surrogate.weights[index], options["rotary"], options["sinks"], options["recent"],
                   options["compress"], shares)  # fmt: skip

    def __init__(self, budget: int, weights: torch.Tensor, rotary: RotaryShift, sinks: int = 4, recent: int = 0,
                 compress: str = "prefill", shares: torch.Tensor | None = None):  # fmt: skip
        self.compress = check_compress(compress)
        check_ranked_budget("KVzap", budget, sinks, recent)
        if weights.ndim != 2 or weights.shape[1] != 3 * rotary.head_dim + 1:
            raise ShapeError(
                f"KVzap weights are [kv_heads, 3 x head_dim + 1 = {3 * rotary.head_dim + 1}], got "
                f"{tuple(weights.shape)}"
            )
        if shares is not None and tuple(shares.shape) != (len(KEEP_GRID),):
            raise ShapeError(f"a layer's shares are [{len(KEEP_GRID)}] (one per kept fraction), got {tuple(shares.shape)}")
        #: The budget asked for (the mean over layers, with `shares`); `budget` is this layer's.
        self.nominal = self.budget = budget
        self.sinks, self.recent = sinks, recent
        self.weights, self.rotary = weights.float(), rotary
        self.shares = None if shares is None else shares.double().tolist()

    def evict(self, store: SlotStore, new: int, refill: bool) -> None:
        """Scores the last forward's tokens, then evicts down to the budget as every policy does."""
        if self.weights.device != store.device:  # once
            self.weights = self.weights.to(store.device)
        keys, values = store.fresh_slots()
        features = kvzap_features(keys, values, store.fresh_positions(), self.rotary)
        store.write_fresh_scores(predict(features, self.weights))
        if self.shares is not None and new > 1 and not self.paused:
            self.budget = self.layer_budget(store.length)
        super().evict(store, new, refill)

    def layer_budget(self, held: int) -> int:
        """This layer's budget when it holds `held` tokens: the nominal budget times its share at the kept fraction
        nominal / held (clamped to the grid), at least sinks + recent + 1. Host arithmetic on Python numbers."""
        kept = min(max(self.nominal / max(held, 1), KEEP_GRID[0]), KEEP_GRID[-1])
        upper = min(max(bisect.bisect_left(KEEP_GRID, kept), 1), len(KEEP_GRID) - 1)
        lo, hi = KEEP_GRID[upper - 1], KEEP_GRID[upper]
        t = min(max((kept - lo) / (hi - lo), 0.0), 1.0)
        share = self.shares[upper - 1] * (1 - t) + self.shares[upper] * t
        return max(self.sinks + self.recent + 1, round(self.nominal * share))

    def score(self, store: SlotStore) -> torch.Tensor:
        ranks = store.scores.masked_fill(store.positions < self.sinks, KEEP) if self.sinks else store.scores
        return padding_and_recent(store, self.recent, ranks)  # (padding, at PAD < sinks, goes first all the same)

    def __repr__(self) -> str:
        options = [f"budget={self.nominal}", f"sinks={self.sinks}", f"recent={self.recent}"]
        options += [f"compress={self.compress!r}"] if self.compress != "prefill" else []
        options += ["budgets='uniform'"] if self.shares is None else []
        return f"KVzapPolicy({', '.join(options)})"
