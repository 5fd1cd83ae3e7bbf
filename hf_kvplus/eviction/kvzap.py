"""KVzap (Jegou et al., 2026, "KVzap: Fast, Adaptive and Faithful KV Cache Pruning"): KVzip's query-agnostic scores
predicted from each token's own key and value by a fitted linear surrogate (`surrogate.Surrogate`).

KVzip (`reconstruction.ReconstructionPolicy`) needs a second forward that repeats the context; the surrogate reads
what the cache already holds, so a token is scored when it arrives, at prefill and at every decode step, inside
`generate()`, for the cost of one small matrix product per layer. A token's features are its key as cached, the same
key rotated back to position 0 (what the layer's projection made of its hidden state) and its value, read off the
slots the last forward wrote (decoded, on quantized slots); each KV head has its own weights.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, ShapeError
from ..storage.slots import SlotStore
from .policy import KEEP, EvictionPolicy, check_compress, padding_and_recent
from .rope import RotaryShift


def kvzap_features(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   rotary: RotaryShift) -> torch.Tensor:  # fmt: skip
    """`[batch, kv_heads, n, 3 x head_dim]` float32: keys as cached, keys before RoPE, values (the "rope_kv"
    features), for keys and values `[batch, kv_heads, n, head_dim]` at `positions` `[batch, kv_heads, n]`."""
    return torch.cat((keys.float(), rotary.unrotate(keys, positions), values.float()), dim=-1)


def predict(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[batch, kv_heads, n]` predicted log scores from `features` `[batch, kv_heads, n, f]` and one layer's
    `weights` `[kv_heads, f + 1]` (the last column the intercept)."""
    return torch.einsum("bhnf,hf->bhn", features, weights[:, :-1]) + weights[None, :, -1:]


class KVzapPolicy(EvictionPolicy):
    """Keeps `budget` tokens per KV head, ranked by a surrogate's predicted log KVzip score (`weights`
    `[kv_heads, 3 x head_dim + 1]`, one layer's), the first `sinks` positions and the `recent` newest first.

    Every forward's tokens are scored as they come, after attention. `compress="prefill"` (default) evicts after
    multi-token forwards only (kvpress's pipeline; decode steps append); `"always"` after every forward, decode steps
    included (a bounded cache), a new token competing with the kept ones on its own score.
    """

    def __init__(self, budget: int, weights: torch.Tensor, rotary: RotaryShift, sinks: int = 4, recent: int = 0,
                 compress: str = "prefill"):  # fmt: skip
        self.compress = check_compress(compress)
        if budget < 1:
            raise ConfigError(f"the KVzap budget must hold at least 1 token, got budget={budget}")
        if sinks < 0 or recent < 0 or sinks + recent >= budget:
            raise ConfigError(
                f"sinks={sinks} + recent={recent} must be >= 0 and leave room for ranked tokens in budget={budget}: "
                f"give sinks + recent <= {budget - 1}"
            )
        if weights.ndim != 2 or weights.shape[1] != 3 * rotary.head_dim + 1:
            raise ShapeError(
                f"KVzap weights are [kv_heads, 3 x head_dim + 1 = {3 * rotary.head_dim + 1}], got "
                f"{tuple(weights.shape)}"
            )
        self.budget, self.sinks, self.recent = budget, sinks, recent
        self.weights, self.rotary = weights.float(), rotary

    def evict(self, store: SlotStore, new: int, refill: bool) -> None:
        """Scores the last forward's tokens, then evicts down to the budget as every policy does."""
        if self.weights.device != store.device:  # once
            self.weights = self.weights.to(store.device)
        keys, values = store.fresh_slots()
        features = kvzap_features(keys, values, store.fresh_positions(), self.rotary)
        store.write_fresh_scores(predict(features, self.weights))
        super().evict(store, new, refill)

    def score(self, store: SlotStore) -> torch.Tensor:
        ranks = store.scores.masked_fill(store.positions < self.sinks, KEEP) if self.sinks else store.scores
        return padding_and_recent(store, self.recent, ranks)  # (padding, at PAD < sinks, goes first all the same)

    def __repr__(self) -> str:
        options = [f"budget={self.budget}", f"sinks={self.sinks}", f"recent={self.recent}"]
        options += [f"compress={self.compress!r}"] if self.compress != "prefill" else []
        return f"KVzapPolicy({', '.join(options)})"
