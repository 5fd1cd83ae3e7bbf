"""Memory accounting read off the cache objects, never estimated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a cache (or one layer of it) holds at rest.

    `payload_bytes` are the bytes of the tokens held; `reserved_bytes` are allocated but not yet filled
    (growth headroom); `metadata_bytes` are everything else a storage format keeps in tensors (scales,
    zero points, block tables). `tokens_seen` is the logical sequence length, `tokens_held` what is kept
    (fewer for windowed or evicting layers); both are per batch row.
    """

    payload_bytes: int = 0
    reserved_bytes: int = 0
    metadata_bytes: int = 0
    tokens_held: int = 0
    tokens_seen: int = 0
    batch_size: int = 0

    @property
    def total_bytes(self) -> int:
        """Everything at rest: payload, headroom and metadata."""
        return self.payload_bytes + self.reserved_bytes + self.metadata_bytes

    @property
    def bytes_per_token(self) -> float:
        """Bytes at rest per token seen by each batch row (0.0 for an empty cache)."""
        tokens = self.tokens_seen * self.batch_size
        return self.total_bytes / tokens if tokens else 0.0

    def __add__(self, other: MemoryReport) -> MemoryReport:
        """Sums two layers of one cache: bytes add up, token counts describe the longest layer."""
        return MemoryReport(
            payload_bytes=self.payload_bytes + other.payload_bytes,
            reserved_bytes=self.reserved_bytes + other.reserved_bytes,
            metadata_bytes=self.metadata_bytes + other.metadata_bytes,
            tokens_held=max(self.tokens_held, other.tokens_held),
            tokens_seen=max(self.tokens_seen, other.tokens_seen),
            batch_size=max(self.batch_size, other.batch_size),
        )


def tensor_bytes(value, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storage behind `value`: plain tensors, tensor subclasses that flatten into
    inner tensors (optimum-quanto's packed tensors), and lists/tuples of them; each storage once."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    if not isinstance(value, torch.Tensor):
        return 0
    if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return sum(tensor_bytes(getattr(value, name), seen) for name in names)
    storage = value.untyped_storage()
    if storage.data_ptr() in seen:
        return 0
    seen.add(storage.data_ptr())
    return storage.nbytes()


def cache_bytes(cache) -> int:
    """Bytes at rest of any `transformers.Cache`: read off hf_kvplus caches, summed over every tensor
    each layer holds for the others (Transformers' dynamic, static and quantized caches)."""
    if hasattr(cache, "memory_report"):
        return cache.memory_report().total_bytes
    seen: set[int] = set()
    return sum(tensor_bytes(value, seen) for layer in cache.layers for value in vars(layer).values())
