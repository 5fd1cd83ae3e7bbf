"""The typed errors the kernels raise, defined at the bottom layer so that the kernels import nothing above them.

``hf_kvplus.errors`` re-exports these very classes beside the cache-level ones: every error of hf_kvplus
derives from :class:`KVPlusError`, so a caller catches the library's failures in one place.
"""

from __future__ import annotations


class KVPlusError(Exception):
    """Base class of every error raised by hf_kvplus."""


class ConfigError(KVPlusError, ValueError):
    """A cache or kernel was configured with values it cannot work with (bad budget, bit width...)."""


class ShapeError(KVPlusError, ValueError):
    """A tensor has the wrong number of dimensions or the wrong size along one of them."""


class DTypeError(KVPlusError, TypeError):
    """A tensor has a dtype the operation does not accept."""


class DeviceError(KVPlusError, ValueError):
    """Tensors that must live on one device live on different ones."""


class KernelUnavailableError(KVPlusError, RuntimeError):
    """A Triton kernel was requested where Triton (or a CUDA device) is not available."""
