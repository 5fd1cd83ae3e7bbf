"""The one place that picks the kernel for what a storage describes (`storage.reads`). Slots (a scored
retention's storage), whose attention also reports the mass each key received, go to `attention.slots`: its decode
(the same kernels, with the mass) or its prefill.

A decode step (one query per row) whose mask the kernels can express goes to the decode kernel that
reads the storage in place: dense, paged or quantized (Triton on CUDA, its torch twin elsewhere).
Everything else (prefill, chunked prefill, dropout, softcapping, a position bias, attention sinks,
a mask with per-head or float entries) gathers the read's tokens densely and goes to SDPA, as
Transformers' "sdpa" attention would.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..errors import UnsupportedModelError
from ..kernels.dispatch import decode_attention, paged_decode_attention, quantized_decode_attention
from ..storage.reads import DenseRead, PagedRead, Read, SlotRead
from .slots import DECODE_REDUCES, slot_decode, slot_prefill

#: Attributes of the key tensor a hf_kvplus layer's `update` returns: the layer that attends over it, and
#: (when it is not the dense keys themselves) the `storage.reads` description of what that layer reads.
KV_SOURCE_ATTR = "_kvplus_layer"
KV_READ_ATTR = "_kvplus_read"

#: Keyword arguments of Transformers' attention functions that the decode kernels do not implement.
_NOT_IN_KERNELS = ("softcap", "position_bias", "s_aux")


def decode_mask(attention_mask: torch.Tensor | None, batch: int) -> torch.Tensor | None | bool:
    """A `[batch, kv]` boolean mask from the model's `[batch|1, 1, 1, kv]` one; False if not expressible."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or attention_mask.ndim != 4 or attention_mask.shape[1] != 1:
        return False
    return attention_mask[:, 0, 0, :].expand(batch, -1)


def kernel_mask(query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None | bool:
    """The decode kernels' mask for this call (None: no mask), or False when the call must go to SDPA."""
    if query.shape[2] != 1 or kwargs.get("dropout"):
        return False
    for name in _NOT_IN_KERNELS:
        if kwargs.get(name) is not None:
            return False
    return decode_mask(attention_mask, query.shape[0])


def attend(
    read: Read, module, query, attention_mask, scaling, mass_queries: int = 0, mass_reduce: str = "sum", **kwargs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[batch, q_len, q_heads, head_dim]` attention of `query` `[batch, q_heads, q_len, head_dim]` over `read`,
    and for slots, the attention mass `[batch, kv_heads, slots]` of the last `mass_queries` queries (else None),
    reduced as the policy declares (`mass_reduce`: summed over them, the largest one gave, or the largest one query head
    gave); a one-query call takes the decode kernel where it reports that reduction (`slots.DECODE_REDUCES`).

    Slots are masked by what they hold, not by the model's mask (which their layer has already noted)."""
    if type(read) is SlotRead:
        for name in ("softcap", "s_aux"):
            if kwargs.get(name) is not None:
                raise UnsupportedModelError(f"evicting caches do not support attention with {name}")
        if query.shape[2] == 1 and mass_reduce in DECODE_REDUCES:  # what the decode kernel reports
            return slot_decode(query, read, scaling, mass_queries=mass_queries)
        return slot_prefill(query, read, scaling, mass_queries=mass_queries, mass_reduce=mass_reduce)
    mask = kernel_mask(query, attention_mask, kwargs)
    if mask is not False:
        q = query[:, :, 0]
        if type(read) is DenseRead:
            out = decode_attention(q, read.keys, read.values, scale=scaling, mask=mask, check=False)
        elif type(read) is PagedRead:
            out = paged_decode_attention(
                q, read.k_pool, read.v_pool, read.block_table, start=read.start, length=read.length,
                scale=scaling, mask=mask, check=False,
            )  # fmt: skip
        else:
            if read.mask is not None:
                mask = read.mask(mask)
            out = quantized_decode_attention(
                q, read.packed, read.fmt, start=read.start, length=read.length, scale=scaling,
                residual_k=read.recent_k, residual_v=read.recent_v, mask=mask, block_table=read.block_table, check=False,
                state=read.state,
            )  # fmt: skip
        return out.unsqueeze(1), None
    keys, values = (read.keys, read.values) if type(read) is DenseRead else read.dense()
    out, _ = sdpa_attention_forward(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
    return out, None


def differentiable_attention(read: Read, module, query, attention_mask, scaling, **kwargs) -> torch.Tensor:
    """SDPA over copies of what `read` describes, as Transformers' "sdpa" attention computes it, for a forward whose
    gradients are wanted: no kernel (they have no backward), and no view of a buffer that later appends write in
    place (autograd refuses a saved tensor modified since)."""
    if type(read) is DenseRead:
        keys, values = read.keys.clone(), read.values.clone()
    else:
        keys, values = read.dense()  # (gathered or dequantized: copies already)
    return sdpa_attention_forward(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)[0]


def dense_attention(module, query, keys, values, attention_mask, scaling, **kwargs) -> torch.Tensor:
    """`attend` over dense `keys`/`values` `[batch, kv_heads, n, head_dim]`."""
    return attend(DenseRead(keys, values), module, query, attention_mask, scaling, **kwargs)[0]

