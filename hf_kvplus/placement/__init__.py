"""Placements: where a layer's K/V bytes rest."""

from .base import Placement
from .device import OnDevice

__all__ = ["Placement", "OnDevice"]
