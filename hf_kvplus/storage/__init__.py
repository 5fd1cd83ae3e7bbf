"""Storage formats: how a layer's K/V bytes are held."""

from .base import KVStorage
from .dense import DenseStorage
from .quantized import QuantizedSegment, QuantizedStorage

__all__ = ["KVStorage", "DenseStorage", "QuantizedSegment", "QuantizedStorage"]
