"""Eviction: the scored retentions (StreamingLLM sinks, H2O heavy hitters, SnapKV, peak attention, KVzip's
reconstruction, KVzap's surrogate), the plug-in base `ScoredPolicy` with its declarations, and rotary shifts for
sinks."""

from .declare import POLICIES, Mass, Needs, Setting, policy_class
from .heavy_hitters import HeavyHitterPolicy
from .kvzap import KVzapPolicy
from .peak import PeakAttentionPolicy
from .policy import EvictionPolicy
from .reconstruction import ReconstructionPolicy
from .rope import RotaryShift
from .scored import ScoredPolicy, SlotView
from .sinks import SinkPolicy
from .snapkv import SnapKVPolicy

__all__ = ["POLICIES", "EvictionPolicy", "HeavyHitterPolicy", "KVzapPolicy", "Mass", "Needs", "PeakAttentionPolicy",
           "ReconstructionPolicy", "RotaryShift", "ScoredPolicy", "Setting", "SinkPolicy", "SlotView", "SnapKVPolicy",
           "policy_class"]  # fmt: skip
