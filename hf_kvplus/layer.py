"""One model layer's cache: a storage, a retention and a placement behind Transformers' layer API."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention.route import KV_READ_ATTR, KV_SOURCE_ATTR, attend
from .errors import CacheMismatchError, ShapeError, UnsupportedOperationError
from .memory import MemoryReport
from .model_spec import LayerSpec
from .placement.base import Placement
from .retention.base import Retention
from .storage.base import KVStorage
from .storage.reads import DenseRead


class PlacedLayer(CacheLayerMixin):
    """What every hf_kvplus cache layer does alike around its `storage` (the object the `placement` moves)
    and its count of tokens `seen`: Transformers' offload/prefetch hooks and the memory report."""

    storage: KVStorage
    placement: Placement
    seen: int

    def offload(self) -> None:
        self.placement.release(self.storage)

    def prefetch(self) -> None:
        self.placement.prefetch(self.storage)

    def memory(self) -> MemoryReport:
        """Bytes at rest of this layer, with the tokens it holds and has seen."""
        report = self.storage.memory()
        return MemoryReport(
            payload_bytes=report.payload_bytes,
            reserved_bytes=report.reserved_bytes,
            metadata_bytes=report.metadata_bytes,
            tokens_held=self.storage.length,
            tokens_seen=self.seen,
            batch_size=report.batch_size,
        )


class KVLayer(PlacedLayer):
    """A `CacheLayerMixin` that composes storage x retention x placement.

    `get_seq_length()` counts the tokens seen; `update` returns the visible held tokens plus the new
    ones and only then lets the retention drop tokens, and `get_mask_sizes` describes exactly that
    (`kv_length = visible + q`, `kv_offset = seen - visible`), which is what sdpa, eager and padded
    batches need to line the mask up with the keys.
    """

    is_compileable = False

    def __init__(self, spec: LayerSpec, storage: KVStorage, retention: Retention, placement: Placement):
        # `CacheLayerMixin.__init__` only sets `keys`/`values`, which are views of the storage here.
        self.spec = spec
        self.storage = storage
        self.retention = retention
        self.placement = placement
        self.is_sliding = spec.kind != "full"
        self.is_initialized = False
        self.record_past = False
        self.seen = 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(index={self.spec.index}, kind={self.spec.kind}, storage="
            f"{type(self.storage).__name__}, retention={self.retention!r}, placement={self.placement!r})"
        )

    @property
    def is_croppable(self) -> bool:
        return self.retention.is_croppable

    @property
    def keys(self) -> torch.Tensor | None:
        """The held keys as a dense view, `[batch, kv_heads, held, head_dim]`."""
        return self._held()[0]

    @property
    def values(self) -> torch.Tensor | None:
        """The held values as a dense view, `[batch, kv_heads, held, head_dim]`."""
        return self._held()[1]

    def _held(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.storage.length:
            return None, None
        with self.placement.using(self.storage):
            return self.storage.view(self.storage.length)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_states(self.spec, key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            check_states(self.spec, key_states, value_states)
        new = key_states.shape[2]
        visible = self.retention.visible(self.storage.length)
        self.placement.acquire(self.storage)
        self.storage.append(key_states, value_states)
        self.seen += new
        read = self.storage.read(visible + new, new)
        keys = read.keys
        setattr(keys, KV_SOURCE_ATTR, self)
        if type(read) is not DenseRead:
            setattr(keys, KV_READ_ATTR, read)
        if not self.record_past:
            self._evict()
        return keys, read.values

    def attend(self, module, query, keys, values, attention_mask, scaling, **kwargs) -> torch.Tensor:
        """Attention over what `update` returned: the storage's read, through `attention.route`."""
        if getattr(module, "layer_idx", self.spec.index) != self.spec.index:
            raise CacheMismatchError(
                f"attention layer {module.layer_idx} received the keys of cache layer {self.spec.index}"
            )
        if attention_mask is not None and self.seen == query.shape[2]:
            self.storage.note_prompt_mask(attention_mask)
        return attend(getattr(keys, KV_READ_ATTR, None) or DenseRead(keys, values), module, query, attention_mask, scaling, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        visible = self.retention.visible(self.storage.length)
        return visible + query_length, self.seen - visible

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.retention.max_length()

    def activate_past_recording(self) -> None:
        """Keeps evicted tokens until the next `crop`, so assisted decoding can roll back."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the newest tokens: `-n` removes n; a positive value is the length to keep (legacy)."""
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, self.seen - tokens_to_remove)
        if remove > self.seen:
            raise UnsupportedOperationError(f"cannot crop {remove} tokens from a layer that has seen {self.seen}")
        needed_after = self.retention.visible(self.seen - remove)
        if self.storage.length - remove < needed_after:
            raise UnsupportedOperationError(
                f"layer {self.spec.index} holds {self.storage.length} tokens; removing {remove} would leave "
                f"{self.storage.length - remove} but the next step needs {needed_after} "
                "(call activate_past_recording() before steps that may be rolled back)"
            )
        with self.placement.using(self.storage):
            if remove:
                self.storage.drop_back(remove)
                self.seen -= remove
            self._evict()

    def reset(self) -> None:
        self.storage.reset()
        self.placement.forget(self.storage)
        self.seen = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        with self.placement.using(self.storage):
            self.storage.index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.storage.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        with self.placement.using(self.storage):
            self.storage.index_batch(row_indices(indices))

    def _evict(self) -> None:
        excess = self.retention.excess(self.storage.length)
        if excess:
            self.storage.drop_front(excess)


def row_indices(indices) -> torch.Tensor:
    """Batch rows to keep as an index tensor: `batch_select_indices` also receives lists and bool masks."""
    indices = torch.as_tensor(indices)
    return indices.nonzero().flatten() if indices.dtype == torch.bool else indices


def check_states(spec: LayerSpec, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Refuses keys/values whose shape does not match the layer the cache built from the model config."""
    if key_states.ndim != 4 or value_states.ndim != 4:
        raise ShapeError(
            f"layer {spec.index} expects 4-d [batch, kv_heads, tokens, head_dim] keys and values, got "
            f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
        )
    if key_states.shape[1] != spec.num_kv_heads or key_states.shape[3] != spec.head_dim:
        raise CacheMismatchError(
            f"layer {spec.index} was built for {spec.num_kv_heads} KV heads of head_dim {spec.head_dim}, "
            f"got keys of shape {tuple(key_states.shape)}: is this cache built from this model's config?"
        )
    if key_states.shape[:3] != value_states.shape[:3]:
        raise ShapeError(
            f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} disagree on batch, heads "
            "or tokens"
        )
