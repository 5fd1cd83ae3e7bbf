"""hf_kvplus: drop-in `transformers.Cache` subclasses for the KV cache.

Importing the package registers the "kvplus" attention implementation, routes "sdpa" attention for
hf_kvplus caches to hf_kvplus's attention path, and lets `cache_implementation="kvplus:<spec>"` name its
caches; nothing else changes (`uninstall()` undoes it).
"""

from .attention import ATTN_IMPLEMENTATION, kvplus_attention
from .cache import DenseCache, KVCache, model_retention
from .calibration import Calibration
from .errors import (
    ArtifactNotFoundError,
    BlockServerError,
    CacheMismatchError,
    CapacityError,
    ConfigError,
    CorruptFileError,
    DeviceError,
    DiskTierError,
    DTypeError,
    FetchError,
    FileFormatError,
    GradientError,
    KernelUnavailableError,
    KVPlusError,
    OutOfRangeError,
    RDataError,
    ShapeError,
    UnsupportedModelError,
    UnsupportedOperationError,
)
from .evicting_cache import EvictingCache, H2OCache, PeakCache, SinkCache, SnapKVCache
from .eviction import EvictionPolicy, Mass, Needs, ScoredPolicy, Setting, SlotView
from .kvzap_cache import KVzapCache
from .kvzip_cache import KVzipCache
from .layer import KVLayer
from .memory import MemoryReport
from .model_spec import LayerSpec, ModelSpec
from .offloaded_cache import OffloadedCache
from .paged_cache import PagedCache
from .paging import BlockPool, FolderBlocks, PagedPool, PrefixStore, RedisBlocks
from .persist import load_cache, save_cache
from .placement import Offloaded, OnDevice, Placement, TierBytes
from .plugin import install, uninstall
from .precision import PrecisionRegions
from .quantized_cache import QuantizedCache, quantized_storage
from .retention import KeepAll, Retention, SlidingWindow
from .storage import DenseStorage, KVStorage, QuantizedStorage, SlotStore, StaticQuantizedStorage
from .surrogate import Surrogate
from .transformers_compat import cache_kwarg, cache_kwargs

__version__ = "0.1.0"

install()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ArtifactNotFoundError",
    "BlockServerError",
    "CacheMismatchError",
    "CapacityError",
    "ConfigError",
    "CorruptFileError",
    "DTypeError",
    "Calibration",
    "DenseCache",
    "DenseStorage",
    "DeviceError",
    "DiskTierError",
    "EvictingCache",
    "EvictionPolicy",
    "FetchError",
    "FileFormatError",
    "FolderBlocks",
    "GradientError",
    "H2OCache",
    "Mass",
    "Needs",
    "PeakCache",
    "ScoredPolicy",
    "Setting",
    "SlotView",
    "KVCache",
    "KVzapCache",
    "KVzipCache",
    "KVLayer",
    "KVPlusError",
    "KVStorage",
    "KeepAll",
    "KernelUnavailableError",
    "LayerSpec",
    "MemoryReport",
    "ModelSpec",
    "Offloaded",
    "OffloadedCache",
    "OutOfRangeError",
    "OnDevice",
    "PagedCache",
    "PagedPool",
    "BlockPool",
    "PrefixStore",
    "Placement",
    "QuantizedCache",
    "PrecisionRegions",
    "QuantizedStorage",
    "StaticQuantizedStorage",
    "RDataError",
    "RedisBlocks",
    "Retention",
    "ShapeError",
    "SinkCache",
    "SlidingWindow",
    "SlotStore",
    "SnapKVCache",
    "Surrogate",
    "TierBytes",
    "UnsupportedModelError",
    "UnsupportedOperationError",
    "cache_kwarg",
    "cache_kwargs",
    "install",
    "kvplus_attention",
    "load_cache",
    "model_retention",
    "quantized_storage",
    "save_cache",
    "uninstall",
]
