"""Caches that outlive the process: `save_cache` / `load_cache` in safetensors with a checked JSON header.

Never unpickle a cache from a source you do not trust: unpickling runs code. These files hold tensors and JSON only.
"""

from ..fingerprint import fingerprint
from .cache_file import load_cache, read_header, save_cache
from .header import FORMAT, FORMAT_VERSION

__all__ = ["FORMAT", "FORMAT_VERSION", "fingerprint", "load_cache", "read_header", "save_cache"]
