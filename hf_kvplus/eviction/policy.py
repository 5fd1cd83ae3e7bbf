"""Eviction policies: which slots of a layer survive once it holds more than its budget."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .slots import PAD, SlotStore

#: Priority of slots that must stay (sinks, the recent window) and of padding slots, which go first.
KEEP = float("inf")
DROP = float("-inf")


class EvictionPolicy(ABC):
    """Ranks a layer's slots per (batch row, KV head); the layer keeps the `budget` highest.

    Padding slots always rank lowest, and ties keep the lowest slot index first, so every head of a
    row evicts padding at the same slots and a row's padding mask stays one `[batch, slots]` tensor.
    """

    #: Slots kept per row and head once the layer is over budget.
    budget: int
    #: Whether `crop` may roll back tokens (assisted decoding); the policy's state must allow it.
    is_croppable: bool = False

    def mass_queries(self, new: int) -> int:
        """How many of the last `new` queries must report the attention mass they give (0: none)."""
        return 0

    def observe(self, store: SlotStore, mass: torch.Tensor, new: int) -> None:  # noqa: B027 - an optional hook
        """Takes the attention mass `[batch, kv_heads, slots]` of the latest forward."""

    def over_budget(self, store: SlotStore, new: int) -> int:
        """Slots to evict after attending `new` fresh tokens (the default: back down to the budget)."""
        return max(0, store.length - self.budget)

    def victim(self, store: SlotStore, first_real: torch.Tensor | None) -> int | None:
        """The one slot to evict after a one-token step, as a Python int, when the policy knows it without
        looking at the device (it is then the same slot in every row and head); None: rank by `priority`."""
        return None

    @abstractmethod
    def priority(self, store: SlotStore, seen: int, first_real: torch.Tensor) -> torch.Tensor:
        """`[batch, kv_heads, slots]` float: higher stays. `first_real` [batch]: first real position per row."""

    def after_evict(self, store: SlotStore, seen: int, first_real: torch.Tensor) -> None:  # noqa: B027 - an optional hook
        """Hook run after every eviction (sinks re-rotate here)."""

    def index_batch(self, indices: torch.Tensor) -> None:  # noqa: B027 - an optional hook
        """Reorders per-row policy state with the cache's rows."""

    def reset(self) -> None:  # noqa: B027 - an optional hook
        """Forgets per-sequence state."""


def padding_and_recent(
    store: SlotStore, seen: int, recent: int, ranks: torch.Tensor, first_real: torch.Tensor | None
) -> torch.Tensor:
    """A copy of `ranks` with the `recent` newest positions set to KEEP and padding slots (there are none
    while `first_real` is None) to DROP."""
    pos = store.positions
    ranks = ranks.masked_fill(pos >= seen - recent, KEEP) if recent else ranks.clone()
    return ranks if first_real is None else ranks.masked_fill(pos == PAD, DROP)
