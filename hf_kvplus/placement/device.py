"""On-device placement: the storage stays where the model runs."""

from .base import Placement


class OnDevice(Placement):
    """The default: K/V live on the model's device; nothing moves."""

    name = "device"

    def prefetch(self, storage) -> None:
        return None

    def release(self, storage) -> None:
        return None

    def __repr__(self) -> str:
        return "OnDevice()"
