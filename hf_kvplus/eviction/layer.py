"""One evicting layer: slots, an eviction policy, and attention over the slots in place."""

from __future__ import annotations

import dataclasses

import torch

from ..attention.route import KV_SOURCE_ATTR
from ..attention.slots import slot_attention
from ..errors import CacheMismatchError, ShapeError, UnsupportedModelError, UnsupportedOperationError
from ..layer import PlacedLayer, check_states, row_indices
from ..memory import MemoryReport
from ..model_spec import LayerSpec
from ..placement.base import Placement
from ..placement.device import OnDevice
from .policy import EvictionPolicy
from .slots import PAD, DenseCodec, SlotStore, TokenQuantCodec


def padding_of_new(attention_mask: torch.Tensor | None, batch: int, new: int) -> torch.Tensor | None:
    """`[batch, new]` True where a fresh token is padding, read off the model's mask; None without a mask.

    The mask's last `new` columns are the fresh tokens (`get_mask_sizes` says so); the last query of a
    left-padded row is real and sees every real key, so the keys it may not see are padding. Whether
    any is padding stays on the device (asking would stall it).
    """
    if attention_mask is None:
        return None
    if attention_mask.ndim != 4:
        raise ShapeError(f"expected a 4-d attention mask, got shape {tuple(attention_mask.shape)}")
    last = attention_mask[:, 0, -1, -new:]
    allowed = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    return ~allowed.expand(batch, -1)


class EvictingLayer(PlacedLayer):
    """A `CacheLayerMixin` whose tokens live in per-head slots and are evicted by a policy after attention.

    `update` appends and returns the slots (the attention path reads them in place); `attend` learns
    which fresh tokens are padding from the model's mask, attends with a mask of its own (slots are
    not in sequence order), hands the attention mass to the policy, then evicts down to the budget.
    With `activate_past_recording()` eviction waits for the next `update`, so `crop` can still remove
    the newest tokens. `get_mask_sizes` reports `(held + q, seen - held)` as DESIGN.md requires.
    A `placement` moves the slots (the policy's per-row state stays on the device).

    Until the model passes a mask, every slot holds a real token and each row's first real position is
    0: policies get `first_real=None` and work in Python ints. Once a mask came (left padding, maybe),
    `first_real` [batch] is kept on the device, updated with each forward's tokens, never read back.
    """

    is_sliding = False

    def __init__(
        self,
        spec: LayerSpec,
        policy: EvictionPolicy,
        codec: DenseCodec | TokenQuantCodec | None = None,
        placement: Placement | None = None,
        compileable: bool = False,
    ):
        self.spec = spec
        # Declared by the cache (`compileable=True`, see `EvictingCache`): a budget fixes the slots' shape
        # once full, and the step's Python ints go dynamic after one recompile.
        self.is_compileable = compileable
        self.policy = policy
        self.store = SlotStore(codec)
        self.placement = placement or OnDevice()
        self.is_initialized = False
        self.record_past = False
        self.seen = 0
        self.first_real: torch.Tensor | None = None  # [batch] first real position per row (-1: none yet), once masked
        self._pending: int | None = None  # fresh tokens of the last forward, while eviction waits
        self._padded = False  # whether a mask ever came (else no slot holds padding, attention needs no mask)
        self._awaiting_attention = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.spec.index}, policy={self.policy!r}, codec={self.store.codec!r})"

    @property
    def is_croppable(self) -> bool:
        return self.policy.is_croppable

    @property
    def storage(self) -> SlotStore:
        """What the placement moves."""
        return self.store

    @property
    def keys(self) -> torch.Tensor | None:
        return self._held()[0]

    @property
    def values(self) -> torch.Tensor | None:
        return self._held()[1]

    def _held(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.store.held:
            return None, None
        with self.placement.using(self.store):
            return self.store.held_view()

    def memory(self) -> MemoryReport:
        return dataclasses.replace(super().memory(), tokens_held=self.store.held)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        check_states(self.spec, key_states, value_states)
        if self._awaiting_attention:
            raise UnsupportedModelError(
                f"layer {self.spec.index}: the last forward's attention did not go through hf_kvplus, so this "
                "evicting cache could neither mask its slots nor score them; load the model with "
                "attn_implementation='sdpa' (the default) or 'kvplus'"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.placement.acquire(self.store)
        if self._pending is not None:
            self._evict(self._pending)
        self.store.append(key_states, value_states, self.seen)
        self.seen += key_states.shape[2]
        self._awaiting_attention = True
        keys, values = self.store.view()
        setattr(keys, KV_SOURCE_ATTR, self)
        return keys, values

    def attend(self, module, query, keys, values, attention_mask, scaling, **kwargs) -> torch.Tensor:
        """Attention over the slots, then eviction (or, while recording the past, eviction deferred)."""
        if getattr(module, "layer_idx", self.spec.index) != self.spec.index:
            raise CacheMismatchError(
                f"attention layer {module.layer_idx} received the keys of cache layer {self.spec.index}"
            )
        for name in ("softcap", "s_aux"):
            if kwargs.get(name) is not None:
                raise UnsupportedModelError(f"evicting caches do not support attention with {name}")
        new = query.shape[2]
        padding = padding_of_new(attention_mask, self.store.batch_size, new)
        if padding is not None:
            self.store.mark_padding(padding)
            self._learn_first_real(new)
        # `keys`/`values` are the very tensors `update` returned (the key carries this layer): the slots'
        # dense view, which marking padding left unchanged; dequantizing it again would double the work.
        valid = self.store.positions[:, 0] != PAD if self._padded else None
        out, mass = slot_attention(query, keys, values, valid, scaling, mass_queries=self.policy.mass_queries(new))
        if mass is not None:
            self.policy.observe(self.store, mass, new)
        self._awaiting_attention = False
        if self.record_past:
            self._pending = new
        else:
            self._evict(new)
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.store.held
        if self._pending is not None:
            held -= self.policy.over_budget(self.store, self._pending)
        return held + query_length, self.seen - held

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def activate_past_recording(self) -> None:
        if not self.policy.is_croppable:
            raise UnsupportedOperationError(
                f"{self.policy!r} cannot roll tokens back (its scores already count the rejected queries); "
                "assisted decoding needs a croppable cache such as SinkCache"
            )
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the newest tokens (only those of the last forward, which eviction has not touched yet)."""
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, self.seen - tokens_to_remove)
        fresh = self._pending or 0
        if remove > fresh:
            raise UnsupportedOperationError(
                f"layer {self.spec.index} can remove at most the {fresh} tokens of its last forward, asked for "
                f"{remove} (call activate_past_recording() first so eviction waits for crop)"
            )
        if remove:
            self.store.drop_back(remove)
            self.seen -= remove
            self._pending = fresh - remove

    def reset(self) -> None:
        self.store.reset()
        self.placement.forget(self.store)
        self.policy.reset()
        self.seen = 0
        self.first_real = None
        self._pending = None
        self._awaiting_attention = False
        self._padded = False
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.store.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = row_indices(indices)
        with self.placement.using(self.store):
            self.store.index_batch(indices)
        self.policy.index_batch(indices)
        if self.first_real is not None:
            self.first_real = self.first_real.index_select(0, indices.to(self.first_real.device))

    def _learn_first_real(self, new: int) -> None:
        """Each row's first real position, from the fresh tokens of a masked forward (on the device)."""
        if not self._padded:
            self._padded = True
            # Tokens before the first mask were real: those rows start at 0; the others are learned now.
            start = 0 if self.seen > new else -1
            self.first_real = torch.full((self.store.batch_size,), start, dtype=torch.int64, device=self.device)
        pos = self.store.fresh_positions()[:, 0]
        real = pos != PAD
        first = torch.where(real.any(-1), pos.masked_fill(~real, self.seen).min(-1).values, -1)
        self.first_real = torch.where(self.first_real >= 0, self.first_real, first)

    def _first_real(self) -> torch.Tensor | None:
        """What policies get: None while every row is real from position 0."""
        return self.first_real if self._padded else None

    def _evict(self, new: int) -> None:
        self._pending = None
        self.store.settle()  # ranking counts every slot (a hole is normally refilled by the append before)
        count = self.policy.over_budget(self.store, new)
        if not count:
            return
        slot = None if self.record_past or new != 1 or count != 1 else self.policy.victim(self.store, self._first_real())
        if slot is not None:  # known without looking at the device: evicted by bookkeeping only
            self.store.free(slot)
            self.policy.after_evict(self.store, self.seen, self._first_real())
            return
        priority = self.policy.priority(self.store, self.seen, self._first_real())
        if new == 1 and count == 1:
            self.store.free(priority.argmin(dim=-1))  # the next one-token append refills it
        else:
            # A stable sort breaks ties (max pooling makes many) towards the lower slot, the older token.
            order = priority.sort(dim=-1, descending=True, stable=True).indices
            self.store.keep(order[..., : self.store.length - count])
        self.policy.after_evict(self.store, self.seen, self._first_real())
