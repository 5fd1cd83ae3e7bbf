"""Eviction: the scored retentions (StreamingLLM sinks, H2O heavy hitters, SnapKV, peak attention) and rotary shifts for sinks."""

from .heavy_hitters import HeavyHitterPolicy
from .peak import PeakAttentionPolicy
from .policy import EvictionPolicy
from .rope import RotaryShift
from .sinks import SinkPolicy
from .snapkv import SnapKVPolicy

__all__ = ["EvictionPolicy", "HeavyHitterPolicy", "PeakAttentionPolicy", "RotaryShift", "SinkPolicy", "SnapKVPolicy"]
