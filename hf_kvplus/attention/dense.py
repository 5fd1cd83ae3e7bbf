"""Attention over dense K/V views: decode through the decode kernel, prefill through SDPA."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..kernels.decode_attention import decode_attention


def decode_mask(attention_mask: torch.Tensor | None, batch: int) -> torch.Tensor | None | bool:
    """A `[batch, kv]` boolean mask from the model's `[batch|1, 1, 1, kv]` one; False if not expressible."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or attention_mask.ndim != 4 or attention_mask.shape[1] != 1:
        return False
    return attention_mask[:, 0, 0, :].expand(batch, -1)


def dense_attention(module, query, keys, values, attention_mask, scaling, dropout=0.0, **kwargs) -> torch.Tensor:
    """`[batch, q_len, q_heads, head_dim]` attention of `query` over `keys`/`values`.

    A single query token per row (decode) goes to the split-KV decode kernel (Triton on CUDA, its
    torch twin elsewhere), which reads each KV head once for its whole query group. Several query
    tokens (prefill, chunked prefill over a non-empty cache) are compute-bound and go to SDPA.
    """
    if query.shape[2] == 1 and not dropout and kwargs.get("softcap") is None and kwargs.get("position_bias") is None:
        mask = decode_mask(attention_mask, query.shape[0])
        if mask is not False:
            out = decode_attention(query[:, :, 0], keys, values, scale=scaling, mask=mask, check=False)
            return out.unsqueeze(1)
    out, _ = sdpa_attention_forward(
        module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return out
