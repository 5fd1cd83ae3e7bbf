"""Placements: where a layer's K/V bytes rest."""

from .base import Placement, TierBytes
from .device import OnDevice
from .disk import DiskTier
from .offloaded import Offloaded

__all__ = ["DiskTier", "Offloaded", "OnDevice", "Placement", "TierBytes"]
