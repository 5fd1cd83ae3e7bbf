"""Typed errors of hf_kvplus.

Every error derives from :class:`KVPlusError`, so a caller can catch the library's failures in one
place, and each message names what was asked and what is available.
"""

from __future__ import annotations

# The errors the kernels raise live with them (the bottom layer); these are the very same classes.
from .kernels.errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    KernelUnavailableError,
    KVPlusError,
    ShapeError,
)

__all__ = [
    "ArtifactNotFoundError", "CacheMismatchError", "CapacityError", "ConfigError", "CorruptFileError", "DeviceError", "DiskTierError", "DTypeError", "FetchError", "FileFormatError",
    "GradientError", "KVPlusError", "KernelUnavailableError", "OutOfRangeError", "RDataError", "ShapeError", "UnsupportedModelError",
    "UnsupportedOperationError",
]  # fmt: skip


class UnsupportedModelError(KVPlusError, ValueError):
    """The model (its config) has a shape or feature the cache cannot serve."""


class CacheMismatchError(KVPlusError, ValueError):
    """A cache built for one model (layer count, heads, head_dim, dtype, device) was fed another's tensors."""


class CapacityError(KVPlusError, RuntimeError):
    """A fixed-size resource (block pool, memory budget) cannot hold what was asked of it."""


class DiskTierError(KVPlusError, OSError):
    """The disk tier of an offloaded cache could not write its files (full disk, unwritable folder).

    A layer it could not write stays whole in host memory and the forward pass goes on, so every layer holds the same
    tokens. The error is raised when the next forward pass starts, before it changes any layer, if the layers left in
    host memory still cannot be written; the message names the bytes it needed and the bytes free. Run that forward
    again once space is freed: the cache carries on.
    """


class UnsupportedOperationError(KVPlusError, RuntimeError):
    """The cache cannot do this operation in its present state (e.g. roll back tokens it has dropped)."""


class GradientError(KVPlusError, RuntimeError):
    """A lossy cache (quantized codes, evicted tokens) was asked to carry gradients: it refuses in grad mode rather
    than return gradients of a function other than the one it computes. Lossless caches (dense, paged, offloaded
    full-precision) carry them as DynamicCache does."""


class OutOfRangeError(KVPlusError, ValueError):
    """Keys or values that a quantized format cannot code: NaN, inf, or finite values beyond the range of its float16
    scales, zero points or norms (`storage.value_range`). Raised where the host waits anyway (a prompt, a report)."""


class FetchError(KVPlusError, RuntimeError):
    """A resource (model file, text) could not be fetched, extracted or converted.

    The message says what was tried (the exact command) and how to supply the file by hand.
    """


class RDataError(KVPlusError, ValueError):
    """An R data file is malformed, or uses a part of the format this reader does not handle."""


class CorruptFileError(KVPlusError, OSError):
    """A file hf_kvplus wrote and reads back (a disk tier's spill file) is not what it wrote: cut short, grown, or
    altered (its checksum differs). The message names the file, the length or checksum expected and found. The data
    is lost: the cache that held it refuses every later use with this error until it is reset."""


class BlockServerError(KVPlusError, ConnectionError):
    """The Redis or Valkey server of a prefix store could not be reached, or refused a command (out of memory with
    `maxmemory-policy noeviction`, a read-only replica). The message names the server, the key and the bytes."""


class FileFormatError(KVPlusError, ValueError):
    """A file is not one this version of hf_kvplus reads: another format, or a format version other than the one it knows.
    The message names what the file says and what was expected."""


class ArtifactNotFoundError(KVPlusError, LookupError):
    """No artifact fitted to this model (a KVzap surrogate, a low-bit calibration) in the user cache folder or the
    package data. The message names the model, the command that makes one, what that cost when measured, and where
    it writes (where the loader looks first)."""
