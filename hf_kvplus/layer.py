"""One model layer's cache: a storage, a retention and a placement behind Transformers' layer API."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention.route import KV_READ_ATTR, KV_SOURCE_ATTR, attend, differentiable_attention
from .errors import (
    CacheMismatchError,
    GradientError,
    ShapeError,
    UnsupportedModelError,
    UnsupportedOperationError,
)
from .kernels.dispatch import prepare
from .memory import MemoryReport
from .model_spec import LayerSpec
from .placement.base import Placement
from .retention.base import Retention
from .storage.base import KVStorage
from .storage.eager_memo import EagerMemo
from .storage.reads import DenseRead, SlotRead
from .storage.value_range import check_prompt, code_limit


class KVLayer(CacheLayerMixin):
    """The one `CacheLayerMixin` of every hf_kvplus cache: storage x retention x placement.

    `get_seq_length()` counts the tokens seen; `update` returns what the storage's read describes (the
    visible held tokens plus the new ones) and `get_mask_sizes` describes exactly that
    (`kv_length = visible + q`, `kv_offset = seen - visible`), which is what sdpa, eager and padded
    batches need to line the mask up with the keys.

    An ordered retention (keep all, a window) drops tokens as soon as `update` has built its return
    value. A scored one (sinks, H2O, SnapKV, over a `SlotStore`) evicts after `attend`: the storage
    notes which fresh tokens the model's mask says are padding, the attention reports the mass each
    slot received and the retention scores them. With `activate_past_recording()` eviction waits (for
    `crop`, or for a scored layer's next `update`), so assisted decoding can roll back.

    `compileable` is the cache's declaration that every decode step has the same shapes once the layer is
    full (a budget of slots), so `generate()` may compile it as it compiles StaticCache. `in_place` says whether the
    model's attention is hf_kvplus's (`attention.dispatch`), which reads a storage in place; a model on eager or
    another attention function gets the read's dense gather instead.

    Gradients: in grad mode, when the query, keys or values require grad, attention is SDPA over copies of the held
    tokens (the kernels have no backward, and later appends write the buffers in place), so a lossless layer's
    gradients are DynamicCache's. A lossy layer (`lossy`: quantized codes or a scored retention) refuses with
    `GradientError` (the cache checks the keys before any layer changes; `attend` checks the query). Without grad
    mode this costs one `torch.is_grad_enabled()` per call.
    """

    is_compileable = False

    def __init__(
        self,
        spec: LayerSpec,
        storage: KVStorage,
        retention: Retention,
        placement: Placement,
        compileable: bool = False,
        in_place: bool = True,
    ):
        # `CacheLayerMixin.__init__` only sets `keys`/`values`, which are views of the storage here.
        self.spec = spec
        self.storage = storage
        self.retention = retention
        self.placement = placement
        self.is_compileable = compileable
        self.in_place = in_place
        self.is_sliding = spec.kind != "full"
        self.is_initialized = False
        self.record_past = False
        self._seen = 0  # `seen`, where the storage does not count it
        self._pending: int | None = None  # a scored layer's fresh tokens of the last forward, while eviction waits
        self._awaiting_attention = False  # a scored layer's update was not yet followed by its attention
        self._checked = EagerMemo()  # `check_states` passed for key and value states of these shapes
        formats = storage.formats()  # quantized: a prompt's values are checked against what the codes hold
        float32 = getattr(getattr(storage, "segment", None), "float32_scales", False)
        self._codes = (formats[0], *code_limit(formats[0], float32)) if formats else None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(index={self.spec.index}, kind={self.spec.kind}, storage="
            f"{type(self.storage).__name__}, retention={self.retention!r}, placement={self.placement!r})"
        )

    @property
    def seen(self) -> int:
        """Tokens seen. A storage that counts on the device (`device_count`: static and compileable ones) counts them
        itself, so that a compiled step reads and writes no Python int."""
        return self.storage.count.value if self.storage.device_count else self._seen

    @seen.setter
    def seen(self, tokens: int) -> None:
        self._seen = tokens  # (read only where the storage does not count: one that does has counted already)

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
        held = self.storage.held
        if not held:
            return None, None
        with self.placement.using(self.storage):
            return self.storage.view(held)

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
            tokens_held=self.storage.held,
            tokens_seen=self.seen,
            batch_size=report.batch_size,
        )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        share = self.spec.rank_share(key_states.shape[1]) if key_states.ndim == 4 else None
        if share is not None:  # a tensor-parallel rank: its share of the config's KV heads, learned here
            self.spec = share
            self.storage.shard_heads(share.num_kv_heads)
        check_states(self.spec, key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        for fmt in self.storage.formats():  # its tables (a rotated format's), made now, not at a decode step's flush
            prepare(fmt, key_states.shape[-1], value_states.shape[-1], self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:  # (a decode step's shapes, once)
            self._checked.get((key_states.shape, value_states.shape), check_states, self.spec, key_states, value_states)
        if self._awaiting_attention:
            what = (
                "this evicting cache could neither mask its slots nor score them"
                if self.retention.scored
                else f"it attended to placeholders instead of the {type(self.storage).__name__}'s blocks or codes"
            )
            raise UnsupportedModelError(
                f"layer {self.spec.index}: the last forward's attention did not go through hf_kvplus, so {what}; "
                "load the model with attn_implementation='sdpa' (the default) or 'kvplus' (a model whose attention "
                "computes on its own, not through Transformers' attention functions, can only use dense caches)"
            )
        new = key_states.shape[2]
        if self._codes is not None and new > 1 and not torch.compiler.is_compiling():
            guard = self.storage.range_guard
            check_prompt(self.spec.index, *self._codes, key_states, value_states, guard and guard.take())
        if self.placement.moves:  # (one that does not has nothing to acquire: a call saved every layer and step)
            self.placement.acquire(self.storage)
        if self._pending is not None:
            self._evict(self._pending)
        # (A static read spans its whole buffer.)
        visible = self.retention.visible(self.storage.length) if self.storage.static_length is None else 0
        self.storage.append(key_states, value_states)
        if not self.storage.device_count:  # else the storage counts, on the device: a compiled step reads no int
            self._seen += new
        read = self.storage.read(visible + new, new)
        if not self.in_place and type(read) is not DenseRead and type(read) is not SlotRead:
            read = DenseRead(*read.dense())  # the model's own attention computes on what it gets
        if not self.in_place and torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            read = DenseRead(read.keys.clone(), read.values.clone())  # (what it saves for backward is never written)
        keys = read.keys
        if type(read) is not DenseRead or self.retention.scored:
            # Placeholders or slots: only hf_kvplus's attention reads them, which `attend` confirms. An alias carries
            # the read, not `read.keys` itself: a read held by the tensor it holds is a reference cycle, which keeps
            # what it views (a pool or buffer since regrown, gathered copies) until the garbage collector runs.
            keys = keys.detach()
            setattr(keys, KV_READ_ATTR, read)
            self._awaiting_attention = True
        setattr(keys, KV_SOURCE_ATTR, self)
        if not self.retention.scored and not self.record_past and self.storage.static_length is None:
            self.retention.evict(self.storage, new, refill=True)
        return keys, read.values

    def attend(self, module, query, keys, values, attention_mask, scaling, **kwargs) -> torch.Tensor:
        """Attention over what `update` returned (the storage's read, through `attention.route`); then a
        scored retention takes the attention mass and evicts (or, while recording the past, waits)."""
        if getattr(module, "layer_idx", self.spec.index) != self.spec.index:
            raise CacheMismatchError(
                f"attention layer {module.layer_idx} received the keys of cache layer {self.spec.index}"
            )
        new = query.shape[2]
        if attention_mask is not None:
            self.storage.note_mask(attention_mask, new)
        elif self.storage.device_count:
            self.storage.note_no_mask()
        read = getattr(keys, KV_READ_ATTR, None)
        if read is None:
            if self._awaiting_attention:
                raise UnsupportedModelError(
                    f"layer {self.spec.index}: the model changed the keys this cache returned before attending, so "
                    f"its attention cannot read the {type(self.storage).__name__} in place; dense caches serve it"
                )
            read = DenseRead(keys, values)
        elif values is not read.values:
            raise UnsupportedModelError(
                f"layer {self.spec.index}: the model changed the values this cache returned before attending, so its "
                f"attention cannot read the {type(self.storage).__name__} in place; dense caches serve it"
            )
        if torch.is_grad_enabled() and (query.requires_grad or keys.requires_grad or values.requires_grad):
            self._awaiting_attention = False
            if self.lossy:
                raise GradientError(self.gradient_refusal())
            return differentiable_attention(read, module, query, attention_mask, scaling, **kwargs)
        if not self.retention.scored:
            self._awaiting_attention = False
            return attend(read, module, query, attention_mask, scaling, **kwargs)[0]
        mass_queries = self.retention.mass_queries(new)
        out, mass = attend(read, module, query, attention_mask, scaling, mass_queries=mass_queries,
                           mass_reduce=self.retention.mass_reduce, **kwargs)  # fmt: skip
        if mass is not None:
            self.retention.observe(self.storage, mass, new)
        self._awaiting_attention = False
        if self.record_past:
            self._pending = new
        else:
            self._evict(new)
        return out

    @property
    def lossy(self) -> bool:
        """Whether what attention reads differs from the keys and values given: quantized codes, or evicted tokens."""
        return bool(self.storage.formats()) or self.retention.scored

    def gradient_refusal(self) -> str:
        formats = self.storage.formats()
        what = f"it holds {formats[0]} codes" if formats else f"{self.retention!r} evicts tokens"
        return (
            f"layer {self.spec.index} of this cache cannot carry gradients ({what}; neither rounding nor eviction has "
            "one): "
            "run the forward under torch.no_grad() (or torch.inference_mode()), or use a lossless cache (DenseCache, "
            "PagedCache or OffloadedCache without bits), which carries them as DynamicCache does"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.storage.static_length is not None:  # every position of the buffer, as StaticCache
            return self.storage.static_length, 0
        if self.retention.scored:
            # Slots are masked by what they hold, not by the model's mask, which attention only reads to learn which
            # tokens it hides (`SlotStore.note_mask`): so it spans every position, which a held token may have (sinks,
            # heavy hitters), and a 0 anywhere in the 2-d mask reaches the slot holding that position. A compileable
            # store's one-token steps keep one shape, its slots (offset 0 until the tokens outnumber them), so that
            # generate's compiled step sees one mask shape (generate builds the mask outside the compiled forward):
            # their mask spans the newest `slots` positions only (older held ones keep what earlier masks said).
            width = self.storage.mask_width
            if width is not None and query_length == 1:
                return width, max(0, self.seen + 1 - width)
            return self.seen + query_length, 0
        held = self.storage.held
        if self._pending is not None:
            held -= self.retention.excess(self.storage.length, self._pending)
        visible = self.retention.visible(held)
        return visible + query_length, self.seen - visible

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens seen; while a compiled step traces a static storage, its device count (as StaticCache's layer
        returns its `cumulative_length`), so that the model's positions take no Python int into the graph."""
        if self.storage.device_count and self.storage.count.tensor is not None and torch.compiler.is_compiling():
            return self.storage.count.tensor
        return self.seen

    def get_max_length(self) -> int:
        static = self.storage.static_length
        return self.retention.max_length() if static is None else static

    def activate_past_recording(self) -> None:
        """Keeps evicted tokens until the next `crop` (or scored update), so assisted decoding can roll back."""
        if not self.retention.is_croppable:
            raise UnsupportedOperationError(
                f"{self.retention!r} cannot roll tokens back (its scores already count the rejected queries); "
                "assisted decoding needs a croppable cache such as SinkCache"
            )
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the newest tokens: `-n` removes n; a positive value is the length to keep (legacy). Transformers 5.17
        passes a 0-d tensor (`candidate_length - n_matches`), read here as the int it is (between steps: the host
        waits for the matches anyway)."""
        tokens_to_remove = int(tokens_to_remove)
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, self.seen - tokens_to_remove)
        if remove > self.seen:
            raise UnsupportedOperationError(f"cannot crop {remove} tokens from a layer that has seen {self.seen}")
        if self.retention.scored:  # only the last forward's tokens, which eviction has not touched yet
            fresh = self._pending or 0
            if remove > fresh:
                raise UnsupportedOperationError(
                    f"layer {self.spec.index} can remove at most the {fresh} tokens of its last forward, asked "
                    f"for {remove} (call activate_past_recording() first so eviction waits for crop)"
                )
        else:
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
            if self.retention.scored:
                self._pending = fresh - remove
            else:
                self._evict(0)

    def attached(self, tokens: int) -> None:
        """The empty storage was given `tokens` tokens from elsewhere (a stored prefix): they count as seen."""
        self.seen = tokens

    def reset(self) -> None:
        self.storage.reset()
        self.placement.forget(self.storage)
        self.retention.reset()
        self.seen = 0
        self._pending = None
        self._awaiting_attention = False
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.storage.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = row_indices(indices)
        with self.placement.using(self.storage):
            self.storage.index_batch(indices)
        self.retention.index_batch(indices)

    def _evict(self, new: int) -> None:
        self._pending = None
        self.retention.evict(self.storage, new, refill=not self.record_past)


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
            f"got keys of shape {tuple(key_states.shape)}: is this cache built from this model's config? (A "
            "tensor-parallel rank may hold a share of the heads that the process group's size divides.)"
        )
    if key_states.shape[:3] != value_states.shape[:3]:
        raise ShapeError(
            f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} disagree on batch, heads "
            "or tokens"
        )
