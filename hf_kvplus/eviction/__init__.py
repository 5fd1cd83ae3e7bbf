"""Evicting layers: per-head token slots, eviction policies, and rotary shifts for sinks."""

from .heavy_hitters import HeavyHitterPolicy
from .layer import EvictingLayer
from .policy import EvictionPolicy
from .rope import RotaryShift
from .sinks import SinkPolicy
from .slots import SlotStore
from .snapkv import SnapKVPolicy

__all__ = ["EvictingLayer", "EvictionPolicy", "HeavyHitterPolicy", "RotaryShift", "SinkPolicy", "SlotStore",
           "SnapKVPolicy"]
