"""Attention over a layer's slots, with the per-key attention mass the evicting policies score by.

Slots hold tokens in any order, so the mask is built here from what the slots hold (padding slots
are never attended) plus causality among the fresh tokens, which sit in the last `q` slots. The
mass of key n for KV head h is the softmax weight it received, summed over the query heads of h's
group and over the queries asked for: decode (`slot_decode`) reads it off the decode kernel (Triton on CUDA, its
torch twin elsewhere), prefill (`slot_prefill`) computes output and mass in one chunked pass; `attention.route`
chooses between them. Quantized slots are read in
place by the quantized decode kernels (keys per token), with or without the mass, and a store's first-tokens region
(`SlotRead.residual_k`) as the kernel's exact residual after them; a prefill over them dequantizes first (the region exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.dispatch import decode_attention, quantized_decode_attention
from ..kernels.quant_format import PACKED_NAMES
from ..storage.reads import SlotRead

#: The mass reductions (`eviction.declare.REDUCES`) the decode kernels report for one query: its weights summed over
#: each KV head's query group, which for one query is also their maximum over queries. Any other goes to `slot_prefill`.
DECODE_REDUCES = ("sum", "max")

#: Prefill computes the score matrix in query chunks of at most this many elements: on the CPU a chunk that stays in
#: cache (2^22 took 0.4-0.6x 2^24's time at 1K-2K tokens), on a GPU larger matrix products.
CPU_CHUNK_ELEMENTS, GPU_CHUNK_ELEMENTS = 1 << 22, 1 << 26


def _prefill_mask(valid: torch.Tensor, q: int) -> torch.Tensor:
    """`[batch, 1, q, n]` bool (`[batch, kv_heads, q, n]` for a per-head `valid`): held slots where valid, fresh slots
    causally (and where valid)."""
    n = valid.shape[-1]
    cols = torch.arange(n, device=valid.device)
    rows = torch.arange(q, device=valid.device)[:, None] + (n - q)
    causal = cols[None, :] <= rows
    if valid.ndim == 3:
        return valid[:, :, None, :] & causal
    return (valid[:, None, :] & causal)[:, None]


def _by_kv_head(t: torch.Tensor | None) -> torch.Tensor | None:
    """`[batch, kv_heads, ...]` as `[batch x kv_heads, 1, ...]` (a view of the slots' buffers)."""
    return None if t is None else t.flatten(0, 1).unsqueeze(1)


def _per_head_decode(query, read: SlotRead, mask: torch.Tensor, scaling: float, with_mass: bool, exact: dict):
    """The decode kernels take one mask per batch row; a per-head `mask` `[batch, kv_heads, n]` (heads that hold
    different tokens, one of them masked) goes in as `batch x kv_heads` rows of one KV head each, whose query heads are
    that KV head's group: the same kernels, views of the same buffers, and the output and mass viewed back."""
    batch, q_heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    kv_heads = mask.shape[1]
    q = query[:, :, 0].reshape(batch * kv_heads, q_heads // kv_heads, dim)
    rows = mask.flatten(0, 1)
    if read.packed is not None and read.fmt.holds_state(read.state):
        # A rotated format's key centre is one per KV head, which rows of one head each cannot take: the slots are
        # dequantized (the first-tokens region exact) and read as full-precision rows.
        keys, values = read.dense()
        rows = read.valid().flatten(0, 1)  # (over the slots: `dense()` holds the region's exact copies in theirs)
        read = SlotRead(keys, values, read.valid)
    if read.packed is not None:
        packed = type(read.packed)(*(_by_kv_head(getattr(read.packed, name)) for name in PACKED_NAMES))
        residual = {name: _by_kv_head(exact[name]) for name in ("residual_k", "residual_v") if name in exact}
        result = quantized_decode_attention(
            q, packed, read.fmt, start=0, length=packed.k.shape[2], scale=scaling, keys_per_token=True,
            with_mass=with_mass, check=False, mask=rows, state=read.state, **residual,
        )  # fmt: skip
    else:
        result = decode_attention(q, _by_kv_head(read.keys), _by_kv_head(read.values), scale=scaling, mask=rows,
                                  with_mass=with_mass, check=False)  # fmt: skip
    out, mass = result if with_mass else (result, None)
    out = out.reshape(batch, q_heads, out.shape[-1])
    return out, None if mass is None else mass.reshape(batch, kv_heads, mass.shape[-1])


def slot_decode(
    query: torch.Tensor, read: SlotRead, scaling: float, *, mass_queries: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per row `[batch, q_heads, 1, d]` over the slots of `read` (`[batch, kv_heads, n, d]`, or their codes,
    read in place): the output `[batch, 1, q_heads, d]` and, with `mass_queries`, the mass `[batch, kv_heads, n]`
    (float32) each slot received. `read.valid()` `[batch, n]` masks the slots holding no real token (`[batch,
    kv_heads, n]` where heads hold different tokens: `_per_head_decode`)."""
    packed, with_mass = read.packed, mass_queries > 0
    if packed is not None:
        slots = packed.k.shape[2]
        if read.residual_k is not None:  # the first-tokens region, exact, after the codes
            exact = {"residual_k": read.residual_k, "residual_v": read.residual_v, "mask": read.decode_mask()}
        else:
            exact = {"mask": read.valid()}
        if exact["mask"] is not None and exact["mask"].ndim == 3:
            out, mass = _per_head_decode(query, read, exact.pop("mask"), scaling, with_mass, exact)
            return out.unsqueeze(1), None if mass is None else mass[..., :slots]
        result = quantized_decode_attention(
            query[:, :, 0], packed, read.fmt, start=0, length=slots, scale=scaling, keys_per_token=True,
            with_mass=with_mass, check=False, state=read.state, **exact,
        )  # fmt: skip
        out, mass = result if with_mass else (result, None)
        if mass is not None and mass.shape[-1] != slots:  # (the region's entries: tokens no policy evicts)
            mass = mass[..., :slots]
    else:
        valid = read.valid()
        if valid is not None and valid.ndim == 3:
            out, mass = _per_head_decode(query, read, valid, scaling, with_mass, {})
            return out.unsqueeze(1), mass
        result = decode_attention(
            query[:, :, 0], read.keys, read.values, scale=scaling, mask=valid, with_mass=with_mass, check=False
        )
        out, mass = result if with_mass else (result, None)
    return out.unsqueeze(1), mass


def slot_prefill(
    query: torch.Tensor, read: SlotRead, scaling: float, *, mass_queries: int = 0, mass_reduce: str = "sum"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of `query` [batch, q_heads, q, d] over the slots of `read` (quantized slots dequantized first), the
    fresh tokens in the last q slots: the output `[batch, q, q_heads, d]` (Transformers' layout) and, when
    `mass_queries` > 0, the attention mass `[batch, kv_heads, n]` (float32) received from the last `mass_queries`
    queries (summed over them; with `mass_reduce="max"`, the largest that one query gave, each query's summed over
    the heads of the KV head's group; with `"max_head"`, the largest weight any one query head of the group gave: KVzip's
    score). A query with no valid key outputs zeros. Queries that report no mass go through SDPA (its causal fast
    path for a first prefill without padding)."""
    q, valid = query.shape[2], read.valid()
    keys, values = read.dense() if read.packed is not None else (read.keys, read.values)
    head = q - mass_queries  # the first queries need their output only: SDPA
    parts = [_sdpa_rows(query[:, :, :head], keys, values, valid, scaling, q)] if head else []
    mass = None
    if mass_queries:
        tail, mass = _rows_with_mass(query[:, :, head:], keys, values, valid, scaling, q, mass_reduce)
        parts.append(tail)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), mass


def _sdpa_rows(rows, keys, values, valid, scaling, q):
    """SDPA output `[batch, q_heads, r, d]` of the first r of the q fresh queries."""
    r, n = rows.shape[2], keys.shape[2]
    if valid is None and n == q:  # a first prefill with no padding: the causal fast path
        return F.scaled_dot_product_attention(
            rows, keys[:, :, :r], values[:, :, :r], is_causal=True, scale=scaling, enable_gqa=True
        )
    valid = torch.ones(keys.shape[0], n, dtype=torch.bool, device=keys.device) if valid is None else valid
    mask = _prefill_mask(valid, q)[:, :, :r]
    if mask.shape[1] > 1:  # per KV head: repeated over each one's query heads
        mask = mask.repeat_interleave(rows.shape[1] // mask.shape[1], dim=1)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def _rows_with_mass(rows, keys, values, valid, scaling, q, reduce="sum"):
    """Output of the last r of the q fresh queries and the mass they give each key, in one chunked pass.

    Keys and values are cast to float32 once, and each chunk builds its own mask rows: at 32K tokens and batch 8
    the whole mask is 8.6 GB, and casting per chunk re-read the keys thousands of times (an H200 ran H2O's prefill
    for minutes). A chunk of queries reads only the slots up to its last query's (causality: the later ones would get
    zero weight), masks only the fresh columns among them, and for a summed mass normalises by a product with the
    rows' reciprocal sums rather than a pass over the weights: 0.45x the time of the full-width pass at 4K on a CPU."""
    batch, q_heads, r, dim = rows.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    grouped = rows.reshape(batch, kv_heads, group, r, dim).float() * scaling
    keys, values = keys.float(), values.float()
    out = rows.new_empty(batch, kv_heads, group, r, values.shape[-1])
    mass = torch.zeros(batch, kv_heads, n, dtype=torch.float32, device=rows.device)
    chunk = CPU_CHUNK_ELEMENTS if keys.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    step = max(1, chunk // max(1, q_heads * n * batch))
    for start in range(0, r, step):
        stop = min(r, start + step)
        width, first = n - r + stop, n - r + start  # slots these queries may read; the first fresh one among them
        logits = torch.einsum("bhgqd,bhnd->bhgqn", grouped[:, :, :, start:stop], keys[:, :, :width])
        cols = torch.arange(first, width, device=keys.device)
        fresh = cols > cols[:, None]  # [chunk, chunk]: the future
        logits[..., first:].masked_fill_(fresh, float("-inf"))
        if valid is not None:  # (one mask per row, or per KV head)
            blocked = ~(valid[:, :, None, None, :width] if valid.ndim == 3 else valid[:, None, None, None, :width])
            logits.masked_fill_(blocked, float("-inf"))
        weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        if valid is not None:  # a query with no valid key (a padding row) gives zeros, not NaN
            weights.nan_to_num_(0.0)
        total = weights.sum(dim=-1, keepdim=True)
        inverse = torch.where(total > 0, total.reciprocal(), torch.zeros_like(total))
        block = torch.einsum("bhgqn,bhnd->bhgqd", weights, values[:, :, :width]) * inverse
        out[:, :, :, start:stop] = block.to(out.dtype)
        if reduce == "sum":
            mass[..., :width] += torch.einsum("bhgqn,bhgq->bhn", weights, inverse[..., 0])
            continue
        weights.mul_(inverse)
        if reduce == "max":
            torch.maximum(mass[..., :width], weights.sum(dim=2).amax(dim=2), out=mass[..., :width])
        else:
            torch.maximum(mass[..., :width], weights.amax(dim=(2, 3)), out=mass[..., :width])
    return out.view(batch, q_heads, r, -1), mass
