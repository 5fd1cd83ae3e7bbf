"""Resolve names to real resources that load offline: models (``load_model``) and long texts (``load_text``).

Everything fetched is kept in the user cache folder (:func:`cache_dir`), so a second run fetches
nothing. See :mod:`hf_kvplus.resolve.cache_dir` for its layout.
"""

from .cache_dir import FetchError, cache_dir, downloads_dir
from .models import BUILTIN_MODELS, load_model
from .rdata import LazyLoadDB, RDataError, read_lazyload, unserialize
from .texts import AUSTEN_BOOKS, load_text

__all__ = [
    "AUSTEN_BOOKS",
    "BUILTIN_MODELS",
    "FetchError",
    "LazyLoadDB",
    "RDataError",
    "cache_dir",
    "downloads_dir",
    "load_model",
    "load_text",
    "read_lazyload",
    "unserialize",
]
