"""Eviction: the scored retentions (StreamingLLM sinks, H2O heavy hitters, SnapKV, peak attention, KVzip's
reconstruction, KVzap's surrogate) and rotary shifts for sinks."""

from .heavy_hitters import HeavyHitterPolicy
from .kvzap import KVzapPolicy
from .peak import PeakAttentionPolicy
from .policy import EvictionPolicy
from .reconstruction import ReconstructionPolicy
from .rope import RotaryShift
from .sinks import SinkPolicy
from .snapkv import SnapKVPolicy

__all__ = ["EvictionPolicy", "HeavyHitterPolicy", "KVzapPolicy", "PeakAttentionPolicy", "ReconstructionPolicy", "RotaryShift",
           "SinkPolicy", "SnapKVPolicy"]  # fmt: skip
