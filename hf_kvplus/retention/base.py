"""Retention: which of the tokens a layer has seen stay in its cache. One interface for every cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..storage.base import KVStorage


class Retention(ABC):
    """Decides, per layer, how many held tokens the next queries may see and which tokens to drop.

    Two kinds share this interface. An *ordered* retention (keep all, sliding window) keeps the newest
    tokens of a sequence-ordered storage: the layer asks `visible(held)` before an update (it sizes the
    mask and the returned K/V) and `evict` right after building the update's return value (never
    before: the current queries still attend to what is dropped). A *scored* retention (`scored = True`,
    `eviction.EvictionPolicy`: sinks, H2O, SnapKV) ranks each head's tokens in a `SlotStore` with its
    `score()`, from the attention mass that hf_kvplus's attention reports, so its layer evicts after
    attention instead.
    """

    #: Whether `crop` can roll the layer back (assisted decoding); a layer that dropped tokens it
    #: would need again refuses instead.
    is_croppable: bool = True
    #: Whether tokens are ranked per head after attention (a `SlotStore` and hf_kvplus's attention needed).
    scored: bool = False

    def visible(self, held: int) -> int:
        """How many of the `held` most recent tokens the next queries attend to (all, by default)."""
        return held

    @abstractmethod
    def excess(self, held: int, new: int) -> int:
        """How many of the `held` tokens to drop once a forward of `new` tokens has been served."""

    def evict(self, storage: KVStorage, new: int, refill: bool) -> None:
        """Drops the `excess` after a forward of `new` tokens: the oldest, for an ordered retention.
        `refill`: the next append brings one token per row, which may take an evicted slot's place."""
        count = self.excess(storage.length, new)
        if count:
            storage.drop_front(count)

    def max_length(self) -> int:
        """Most tokens the layer ever keeps between steps, or -1 for no bound."""
        return -1

    def index_batch(self, indices: torch.Tensor) -> None:  # noqa: B027 - an optional hook
        """Reorders per-row state with the cache's rows."""

    def reset(self) -> None:  # noqa: B027 - an optional hook
        """Forgets per-sequence state."""
