"""Typed errors of hf_kvplus.

Every error derives from :class:`KVPlusError`, so a caller can catch the library's failures in one
place, and each message names what was asked and what is available.
"""

from __future__ import annotations


class KVPlusError(Exception):
    """Base class of every error raised by hf_kvplus."""


class ConfigError(KVPlusError, ValueError):
    """A cache or kernel was configured with values it cannot work with (bad budget, bit width...)."""


class UnsupportedModelError(KVPlusError, ValueError):
    """The model (its config) has a shape or feature the cache cannot serve."""


class CacheMismatchError(KVPlusError, ValueError):
    """A cache built for one model (layer count, heads, head_dim, dtype, device) was fed another's tensors."""


class ShapeError(KVPlusError, ValueError):
    """A tensor has the wrong number of dimensions or the wrong size along one of them."""


class DTypeError(KVPlusError, TypeError):
    """A tensor has a dtype the operation does not accept."""


class DeviceError(KVPlusError, ValueError):
    """Tensors that must live on one device live on different ones."""


class CapacityError(KVPlusError, RuntimeError):
    """A fixed-size resource (block pool, memory budget) cannot hold what was asked of it."""


class DiskTierError(KVPlusError, OSError):
    """The disk tier of an offloaded cache could not write its files (full disk, unwritable folder).

    The layer it was moving stays where it was, so the cache is still whole and usable.
    """


class KernelUnavailableError(KVPlusError, RuntimeError):
    """A Triton kernel was requested where Triton (or a CUDA device) is not available."""


class UnsupportedOperationError(KVPlusError, RuntimeError):
    """The cache cannot do this operation in its present state (e.g. roll back tokens it has dropped)."""


class FetchError(KVPlusError, RuntimeError):
    """A resource (model file, text) could not be fetched, extracted or converted.

    The message says what was tried (the exact command) and how to supply the file by hand.
    """



class RDataError(KVPlusError, ValueError):
    """An R data file is malformed, or uses a part of the format this reader does not handle."""

