"""Placement: where a layer's storage lives between uses (accelerator, host memory, disk)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TierBytes:
    """Bytes of a cache's K/V by where they are: working copies on the compute device, host memory, disk."""

    device: int = 0
    host: int = 0
    disk: int = 0

    def __add__(self, other: TierBytes) -> TierBytes:
        return TierBytes(self.device + other.device, self.host + other.host, self.disk + other.disk)


class Placement(ABC):
    """Moves a layer's storage to where attention reads it, and back to where it rests.

    The cache calls `prefetch` for the layers ahead of the one it updates, `acquire` before a layer's
    storage is used and `release` once its attention has been issued, so a placement that rests the
    bytes elsewhere can overlap the transfers with compute. `using` wraps an operation outside a
    forward pass (crop, beam reorder, a read) in an acquire/release. A placement serves the storages
    of one cache; `moves` tells the cache whether to schedule it at all.
    """

    name: str
    #: Whether the placement moves bytes (the cache skips the scheduling for one that does not).
    moves: bool = False

    @abstractmethod
    def prefetch(self, storage) -> None:
        """Starts bringing `storage` to the device attention runs on."""

    @abstractmethod
    def release(self, storage) -> None:
        """Sends `storage` back to where it rests after use."""

    def register(self, storage) -> None:
        """Takes `storage` into the placement's care; raises `UnsupportedOperationError` if it cannot move it."""
        return None  # nothing to do for a placement that does not move bytes

    def acquire(self, storage) -> None:
        """Makes `storage` usable on the compute device now (waits for its prefetch)."""
        return None  # nothing to do for a placement that does not move bytes

    def forget(self, storage) -> None:
        """Drops what the placement holds for `storage` (it was reset)."""
        return None  # nothing to do for a placement that does not move bytes

    def attach(self, device: torch.device) -> None:
        """Learns the compute device from the first keys the cache sees."""
        return None  # nothing to do for a placement that does not move bytes

    def begin(self) -> None:
        """Called before the first layer of a forward pass is updated."""
        return None  # nothing to do for a placement that does not move bytes

    def is_acquired(self, storage) -> bool:
        return True

    def gradient_refusal(self) -> str | None:
        """Why keys and values that require grad cannot rest here (the copies would lose their history), or None."""
        return None

    @contextmanager
    def using(self, storage) -> Iterator[None]:
        """`storage` usable for the duration, and put back at rest afterwards if it was at rest before."""
        was = self.is_acquired(storage)
        self.acquire(storage)
        try:
            yield
        finally:
            if not was:
                self.release(storage)

    def tier_bytes(self, storages: Iterable) -> TierBytes:
        """Bytes of `storages` per tier (on the device by default)."""
        return TierBytes(device=sum(storage.memory().total_bytes for storage in storages))
