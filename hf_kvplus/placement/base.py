"""Placement: where a layer's storage lives between uses (accelerator, host memory, disk)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..storage.base import KVStorage


class Placement(ABC):
    """Moves a layer's storage to where attention reads it, and back to where it rests.

    The cache calls `prefetch` for a layer ahead of its use and `release` once its attention has
    run, so a placement that rests the bytes elsewhere can overlap the transfers with compute.
    """

    name: str

    @abstractmethod
    def prefetch(self, storage: KVStorage) -> None:
        """Starts bringing `storage` to the device attention runs on."""

    @abstractmethod
    def release(self, storage: KVStorage) -> None:
        """Sends `storage` back to where it rests after use."""
