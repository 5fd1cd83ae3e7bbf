"""Retention: which of the tokens a layer has seen stay in its cache."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Retention(ABC):
    """Decides, per layer, how many held tokens the next queries may see and which tokens to drop.

    The layer asks `visible(held)` before an update (it sizes the mask and the returned K/V) and
    `excess(held)` after building the update's return value (evict after, never before: the current
    queries still attend to what is dropped).
    """

    #: Whether `crop` can roll the layer back (assisted decoding); a layer that dropped tokens it
    #: would need again refuses instead.
    is_croppable: bool = True

    @abstractmethod
    def visible(self, held: int) -> int:
        """How many of the `held` most recent tokens the next queries attend to."""

    @abstractmethod
    def excess(self, held: int) -> int:
        """How many of the oldest held tokens to drop once an update has been served."""

    def max_length(self) -> int:
        """Most tokens the layer ever keeps between steps, or -1 for no bound."""
        return -1
