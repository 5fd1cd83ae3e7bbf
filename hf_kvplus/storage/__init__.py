"""Storage formats: how a layer's K/V bytes are held."""

from .base import KVStorage
from .dense import DenseStorage
from .quantized import QuantizedSegment, QuantizedStorage
from .slots import SlotStore
from .static_quantized import StaticQuantizedStorage
from .token_count import TokenCount

__all__ = [
    "KVStorage", "DenseStorage", "QuantizedSegment", "QuantizedStorage", "SlotStore",
    "StaticQuantizedStorage", "TokenCount",
]  # fmt: skip
