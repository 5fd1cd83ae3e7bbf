"""Retention policies: which tokens a layer keeps."""

from .base import Retention
from .keep_all import KeepAll
from .window import SlidingWindow

__all__ = ["Retention", "KeepAll", "SlidingWindow"]
