"""Eviction: the scored retentions (StreamingLLM sinks, H2O heavy hitters, SnapKV) and rotary shifts for sinks."""

from .heavy_hitters import HeavyHitterPolicy
from .policy import EvictionPolicy
from .rope import RotaryShift
from .sinks import SinkPolicy
from .snapkv import SnapKVPolicy

__all__ = ["EvictionPolicy", "HeavyHitterPolicy", "RotaryShift", "SinkPolicy", "SnapKVPolicy"]
