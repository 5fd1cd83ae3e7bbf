"""Paged attention: decode attention over K/V held in fixed-size blocks of a pool, and the store into it.

Storage (one layer): ``k_pool`` [num_blocks, Hkv, block_size, D] and ``v_pool`` [num_blocks, Hkv,
block_size, Dv], in q's dtype; ``block_size`` is a power of two in 8..128. Row b of ``block_table``
(int32 [B, columns]) lists the blocks of batch row b: logical token t of row b lives in block
``block_table[b, t // block_size]`` at offset ``t % block_size``. Rows may share blocks (beams).

Attention. Every row attends to the same logical tokens ``start .. start + length - 1`` (``start`` may
fall mid-block; table columns outside the ones those tokens use are never read and may hold anything,
e.g. -1), with an optional bool mask [B, length] (True = attend). q [B, Hq, D], Hq % Hkv == 0 (query
head h reads KV head h // (Hq // Hkv)); output [B, Hq, Dv] in q.dtype; a row whose keys are all masked
outputs zeros.

- ``paged_decode_attention`` (``kernels/dispatch.py``) dispatches: CUDA tensors go to Triton, everything else
  to the twin.
- :func:`paged_decode_attention_triton` is the split-KV kernel of ``decode_attention`` compiled with
  its paged storage switch (``PAGED=True``): each program walks one slice of keys for one (batch row,
  KV head) and its whole query group, looking up each key's block in the table; the same merge kernel
  combines the splits.
- :func:`paged_decode_attention_torch` is the twin: it walks the table in chunks of blocks (up to
  ``TWIN_CHUNK_TOKENS`` keys), gathers one chunk of all rows and heads at a time and merges the chunks
  with an online softmax in float32, so the sequence is never copied whole.

Store. ``paged_store`` (``kernels/dispatch.py``; twins :func:`paged_store_torch`, :func:`paged_store_triton`) writes ``keys[b, :, i]`` / ``values[b, :, i]`` (keys [B, Hkv, n, D], values
[B, Hkv, n, Dv]) to pool slot ``slot_mapping[b, i]`` (int64 [B, n]; slot s is block s // block_size,
offset s % block_size; -1 = skip), in place and bit-exact. Both paths skip slot -1; the twin rejects
slots outside -1..num_blocks*block_size-1 with a typed error, the Triton path (no host sync) skips
them. Slots written twice in one call: which value lands is unspecified.

The Triton paths check shapes, dtypes and devices but not the values inside the block table or the
slot mapping (that needs a host sync): a block id outside 0..num_blocks-1 in a column that is read
counts as a masked key there (the twin raises ShapeError), never as an out-of-bounds read.

``check`` (keyword, every entry point; the dispatchers pass it on): True (the default) validates as above.
False skips every check (types, shapes, dtypes, devices, ranges, ``num_splits``, whether Triton can
run) and the twins' host reads of table and slot values: sizes come off the shapes only, and no path
reads a tensor value on the host. For callers whose inputs are valid by construction (the caches'
storages); they guarantee that every block id the attention reads is in 0..num_blocks-1 and that
every slot of a store is in 0..num_blocks*block_size-1 (no -1). Invalid input is undefined behaviour.
While ``torch.compile`` (or ``torch.export``) traces, a dispatcher called with ``check=False`` runs
one custom operator, ``torch.ops.kvplus.paged_decode_attention`` / ``paged_store`` (``kernels/custom_ops.py``),
which runs the same Triton kernel or twin; attention off CUDA is the twin traced inline instead.
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels.decode_attention import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    SUPPORTED_DTYPES,
    _check_mask_and_scale,
    _check_num_splits,
    _is_interpreted,
    _split_kv_attention,
    grouped_sdpa,
)
from hf_kvplus.kernels.errors import ConfigError, DeviceError, DTypeError, KernelUnavailableError, ShapeError

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twins still work without triton
    triton = None
    tl = None

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "paged_decode_attention_torch",
    "paged_decode_attention_triton",
    "paged_store_torch",
    "paged_store_triton",
]

MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 128
#: Block size in tokens. 16 is vLLM's default: a block of K/V for head_dim 128 in fp16 is 4 KiB per
#: head, a whole number of the decode kernel's 16..64-key tiles, and a sequence wastes at most 15
#: token slots per layer.
DEFAULT_BLOCK_SIZE = 16
# Keys per chunk of the torch twin (whole blocks: max(1, TWIN_CHUNK_TOKENS // block_size) columns).
TWIN_CHUNK_TOKENS = 1024
# Tokens per program of the store kernel.
STORE_BLOCK_T = 16
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_pools(k_pool, v_pool) -> tuple[int, int, int, int, int]:
    """Validate the pool pair; return (num_blocks, Hkv, block_size, D, Dv)."""
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(
                f"{name} must have 4 dims ([num_blocks, Hkv, block_size, head_dim]), "
                f"got {t.dim()} dims with shape {tuple(t.shape)}"
            )
    if k_pool.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(f"k_pool dtype {k_pool.dtype} is not supported; expected one of {SUPPORTED_DTYPES}")
    if v_pool.dtype != k_pool.dtype:
        raise DTypeError(
            f"k_pool and v_pool must share one dtype, got k_pool {k_pool.dtype}, v_pool {v_pool.dtype}"
        )
    if v_pool.device != k_pool.device:
        raise DeviceError(
            f"k_pool and v_pool must be on one device, got k_pool {k_pool.device}, v_pool {v_pool.device}"
        )
    nb, hkv, bs, d = k_pool.shape
    nb_v, hkv_v, bs_v, dv = v_pool.shape
    if (nb_v, hkv_v, bs_v) != (nb, hkv, bs):
        raise ShapeError(
            f"k_pool and v_pool differ in [num_blocks, Hkv, block_size]: k_pool {[nb, hkv, bs]}, "
            f"v_pool {[nb_v, hkv_v, bs_v]}"
        )
    if nb == 0 or hkv == 0:
        raise ShapeError(f"the pools need at least one block and one KV head, got num_blocks={nb}, Hkv={hkv}")
    if not (MIN_BLOCK_SIZE <= bs <= MAX_BLOCK_SIZE and bs & (bs - 1) == 0):
        raise ConfigError(
            f"block_size={bs} (pool dim 2) is not supported; expected a power of two in "
            f"{MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}"
        )
    return _pool_dims(k_pool, v_pool)


def _pool_dims(k_pool, v_pool) -> tuple[int, int, int, int, int]:
    """(num_blocks, Hkv, block_size, D, Dv) read off the shapes, no checks."""
    nb, hkv, bs, d = k_pool.shape
    return nb, hkv, bs, d, v_pool.shape[3]


def _check_attention_inputs(q, k_pool, v_pool, block_table, start, length, scale, mask, num_splits):
    """Validate the attention contract; return (B, Hq, Hkv, G, D, Dv, block_size, num_blocks)."""
    if not isinstance(q, torch.Tensor):
        raise DTypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ShapeError(f"q must have 3 dims ([B, Hq, D]), got {q.dim()} dims with shape {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(f"q dtype {q.dtype} is not supported; expected one of {SUPPORTED_DTYPES}")
    nb, Hkv, bs, Dk, Dv = _check_pools(k_pool, v_pool)
    if k_pool.dtype != q.dtype:
        raise DTypeError(f"q and the pools must share one dtype, got q {q.dtype}, pools {k_pool.dtype}")
    if k_pool.device != q.device:
        raise DeviceError(f"q and the pools must be on one device, got q {q.device}, pools {k_pool.device}")

    B, Hq, D = q.shape
    if B == 0 or Hq == 0:
        raise ShapeError(f"batch and head counts must be positive, got B={B}, Hq={Hq}")
    if Hq % Hkv != 0:
        raise ShapeError(
            f"query heads Hq={Hq} must be a multiple of KV heads Hkv={Hkv} (remainder {Hq % Hkv})"
        )
    if Dk != D:
        raise ShapeError(f"head_dim mismatch: q has D={D}, k_pool has D={Dk}")
    for name, d in (("head_dim D", D), ("value head_dim Dv", Dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ShapeError(f"{name}={d} is not supported; expected {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")

    if not isinstance(block_table, torch.Tensor):
        raise DTypeError(f"block_table must be an int32 torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise DTypeError(f"block_table dtype must be torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2:
        raise ShapeError(
            f"block_table must have 2 dims ([B, columns]), got {block_table.dim()} dims with shape "
            f"{tuple(block_table.shape)}"
        )
    if block_table.shape[0] != B:
        raise ShapeError(f"batch size mismatch: q has B={B}, block_table has {block_table.shape[0]} rows")
    if block_table.device != q.device:
        raise DeviceError(f"block_table is on {block_table.device}, q and the pools on {q.device}")

    if not _is_int(start) or start < 0:
        raise ConfigError(f"start must be an int >= 0, got {start!r}")
    if not _is_int(length):
        raise ConfigError(f"length must be an int >= 1, got {length!r}")
    if length < 1:
        raise ShapeError(f"no keys to attend to: length={length}")
    columns = block_table.shape[1]
    if start + length > columns * bs:
        raise ShapeError(
            f"tokens {start}..{start + length - 1} (start={start}, length={length}) need "
            f"{(start + length - 1) // bs + 1} table columns of block_size {bs}; block_table has {columns} "
            f"columns ({columns * bs} tokens)"
        )

    _check_mask_and_scale(mask, scale, (B, length), "[B, length]", q.device, "q and the pools")
    _check_num_splits(num_splits)
    return _attention_dims(q, k_pool, v_pool)


def _attention_dims(q, k_pool, v_pool) -> tuple[int, int, int, int, int, int, int, int]:
    """(B, Hq, Hkv, G, D, Dv, block_size, num_blocks) read off the shapes, no checks."""
    B, Hq, D = q.shape
    nb, Hkv, bs, _, Dv = _pool_dims(k_pool, v_pool)
    return B, Hq, Hkv, Hq // Hkv, D, Dv, bs, nb


def _check_store_inputs(k_pool, v_pool, keys, values, slot_mapping) -> tuple[int, int, int, int]:
    """Validate the store contract; return (B, n, block_size, num_blocks)."""
    nb, Hkv, bs, D, Dv = _check_pools(k_pool, v_pool)
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(
                f"{name} must have 4 dims ([B, Hkv, n, head_dim]), got {t.dim()} dims with shape {tuple(t.shape)}"
            )
        if t.dtype != k_pool.dtype:
            raise DTypeError(f"{name} dtype {t.dtype} differs from the pools' dtype {k_pool.dtype}")
        if t.device != k_pool.device:
            raise DeviceError(f"{name} is on {t.device}, the pools on {k_pool.device}")
    B, hk, n, dk = keys.shape
    Bv, hv, nv, dv = values.shape
    if (Bv, nv) != (B, n):
        raise ShapeError(f"keys and values differ in [B, n]: keys {[B, n]}, values {[Bv, nv]}")
    if hk != Hkv or hv != Hkv:
        raise ShapeError(f"KV head count mismatch: pools have Hkv={Hkv}, keys {hk}, values {hv}")
    if dk != D:
        raise ShapeError(f"head_dim mismatch: k_pool has D={D}, keys have {dk}")
    if dv != Dv:
        raise ShapeError(f"value head_dim mismatch: v_pool has Dv={Dv}, values have {dv}")
    if not isinstance(slot_mapping, torch.Tensor):
        raise DTypeError(f"slot_mapping must be an int64 torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype != torch.int64:
        raise DTypeError(f"slot_mapping dtype must be torch.int64, got {slot_mapping.dtype}")
    if tuple(slot_mapping.shape) != (B, n):
        raise ShapeError(f"slot_mapping shape must be [B, n] = [{B}, {n}], got {list(slot_mapping.shape)}")
    if slot_mapping.device != k_pool.device:
        raise DeviceError(f"slot_mapping is on {slot_mapping.device}, the pools on {k_pool.device}")
    return _store_dims(k_pool, keys)


def _store_dims(k_pool, keys) -> tuple[int, int, int, int]:
    """(B, n, block_size, num_blocks) read off the shapes, no checks."""
    B, _, n, _ = keys.shape
    nb, _, bs, _ = k_pool.shape
    return B, n, bs, nb


def _check_triton(name: str) -> None:
    if triton is None:
        raise KernelUnavailableError(f"{name} needs triton, which is not installed")


def _check_runnable(name: str, device: torch.device) -> None:
    """After validation: CUDA tensors, or the kernels were decorated under TRITON_INTERPRET=1."""
    if device.type != "cuda" and not _is_interpreted(_paged_store_kernel):
        raise KernelUnavailableError(
            f"{name} needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before import; "
            f"use {name.replace('_triton', '_torch')}"
        )


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------


def paged_decode_attention_triton(
    q, k_pool, v_pool, block_table, *, start, length, scale, mask=None, num_splits=None, check: bool = True
) -> torch.Tensor:
    """Split-KV flash-decoding over the pools (CUDA tensors, or any tensors under TRITON_INTERPRET=1).

    ``num_splits``: the ``length`` keys are cut into that many slices (clamped so none is empty);
    None picks it with ``pick_num_splits``.
    """
    if check:
        _check_triton("paged_decode_attention_triton")
        _check_attention_inputs(q, k_pool, v_pool, block_table, start, length, scale, mask, num_splits)
        _check_runnable("paged_decode_attention_triton", q.device)
    bs = k_pool.shape[2]
    # The kernel assumes unit stride along the head dim (the pools are copied only if they lack it).
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_pool.stride(-1) != 1:
        k_pool = k_pool.contiguous()
    if v_pool.stride(-1) != 1:
        v_pool = v_pool.contiguous()
    return _split_kv_attention(
        q, k_pool, v_pool, mask, scale=scale, num_splits=num_splits, n_keys=length,
        block_table=block_table, start=start, block_size=bs,
    )


def _check_block_ids(used, nb, first_col, end_col, start, length) -> None:
    """The twins' check that the table columns read (``used``) hold block ids 0..nb-1 (reads the table)."""
    lo_id, hi_id = int(used.min()), int(used.max())
    if lo_id < 0 or hi_id >= nb:
        bad = lo_id if lo_id < 0 else hi_id
        raise ShapeError(
            f"block_table holds block id {bad} in the columns read ({first_col}..{end_col - 1}, tokens "
            f"{start}..{start + length - 1}); the pools have {nb} blocks (ids 0..{nb - 1})"
        )


def _head_rows(block_table: torch.Tensor, first_col: int, end_col: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `block * Hkv + head` of table columns first_col..end_col-1 in the pools seen as
    [num_blocks * Hkv, block_size * dim]: [B, Hkv, columns] int64, and flattened (the gather index of
    contiguous pools). Kept on the table tensor until it or the columns change: a paged cache rebuilds its
    table tensor whenever a block is added, so a decode step otherwise rebuilds the same index (6 ops)."""
    # An inference tensor has no version counter to tell an in-place change: its index is not kept. Nor is
    # it while compiling: a graph computes it once per call anyway, and cannot keep it on a tensor.
    keep = not (torch.compiler.is_compiling() or block_table.is_inference())
    key = (first_col, end_col, hkv, block_table._version) if keep else None
    cached = getattr(block_table, "_kvplus_head_rows", None) if keep else None
    if cached is not None and cached[0] == key:
        return cached[1]
    used = block_table[:, first_col:end_col].long()
    rows = used[:, None, :] * hkv + torch.arange(hkv, device=used.device)[None, :, None]
    if key is not None:
        block_table._kvplus_head_rows = (key, (rows, rows.reshape(-1)))
    return rows, rows.reshape(-1)


def _gather_chunk(pool: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Blocks ``ids`` (integer [B, c]) of every head as one [B, Hkv, c * block_size, dim] tensor.

    ``rows`` (contiguous pools only): the same blocks as rows of the pool seen as
    [num_blocks * Hkv, block_size * dim], row (block, head) = block * Hkv + head, in (b, head, column)
    order: the copy then comes out head-major, one memcpy per block and head.
    """
    nb, hkv, bs, dim = pool.shape
    B, c = ids.shape
    if rows is not None:  # [rows, bs, dim], not [rows, bs * dim]: compiled, the view to [B, hkv, c * bs, dim] then
        # merges whole dims; from bs * dim, inductor copied the gathered keys again, element by element
        return pool.view(nb * hkv, bs, dim).index_select(0, rows).view(B, hkv, c * bs, dim)
    picked = pool.index_select(0, ids.reshape(-1).long()).view(B, c, hkv, bs, dim)
    return picked.transpose(1, 2).reshape(B, hkv, c * bs, dim)


def paged_decode_attention_torch(
    q, k_pool, v_pool, block_table, *, start, length, scale, mask=None, check: bool = True
) -> torch.Tensor:
    """Plain-torch twin: walks the table a chunk of blocks at a time, online softmax in float32 (a
    single chunk is one float32 SDPA).

    Each chunk (up to TWIN_CHUNK_TOKENS keys) of all rows and KV heads is gathered with one
    index_select per pool, then q k^T and p v run as batched matmuls over (row, KV head) with the
    query group as the rows. Also checks that the table columns it reads hold block ids of the pool
    (ShapeError otherwise; a host read of the table, skipped with ``check=False``).
    """
    if check:
        dims = _check_attention_inputs(q, k_pool, v_pool, block_table, start, length, scale, mask, None)
    else:
        dims = _attention_dims(q, k_pool, v_pool)
    B, Hq, Hkv, G, D, Dv, bs, nb = dims
    first_col, end_col = start // bs, (start + length - 1) // bs + 1
    used = block_table[:, first_col:end_col]
    if check:
        _check_block_ids(used, nb, first_col, end_col, start, length)

    dev = q.device
    flat_k, flat_v = k_pool.is_contiguous(), v_pool.is_contiguous()
    if flat_k or flat_v:
        all_rows, flat_rows = _head_rows(block_table, first_col, end_col, Hkv)
    cols_per_chunk = max(1, TWIN_CHUNK_TOKENS // bs)
    if end_col - first_col <= cols_per_chunk:  # one chunk: one float32 SDPA (fewer ops than the online softmax)
        lo = start - first_col * bs
        kc = _gather_chunk(k_pool, used, flat_rows if flat_k else None)[:, :, lo : lo + length]
        vc = _gather_chunk(v_pool, used, flat_rows if flat_v else None)[:, :, lo : lo + length]
        return grouped_sdpa(q.float(), kc.float(), vc.float(), mask, scale).to(q.dtype)
    # Scores in the log2 domain, as in the kernel: exp2 is cheaper than exp on CPUs too.
    qg = q.reshape(B, Hkv, G, D).to(torch.float32) * (float(scale) * LOG2E)
    # Additive mask: 0 where attended, -inf where masked (exp2(-inf - finite max) = 0).
    bias = None
    if mask is not None:
        bias = torch.zeros(B, length, dtype=torch.float32, device=dev).masked_fill_(~mask, float("-inf"))
    m_run = l_run = acc = None
    for c in range(first_col, end_col, cols_per_chunk):
        c_end = min(c + cols_per_chunk, end_col)
        ids = used[:, c - first_col : c_end - first_col]
        rows = all_rows[:, :, c - first_col : c_end - first_col].reshape(-1) if flat_k or flat_v else None
        # Keys of this chunk inside start..start+length-1, as offsets into the gathered chunk.
        lo = max(start - c * bs, 0)
        hi = min(start + length - c * bs, (c_end - c) * bs)
        kc = _gather_chunk(k_pool, ids, rows if flat_k else None)
        vc = _gather_chunk(v_pool, ids, rows if flat_v else None)
        if lo > 0 or hi < kc.shape[2]:
            kc, vc = kc[:, :, lo:hi], vc[:, :, lo:hi]
        s = torch.matmul(qg, kc.to(torch.float32).transpose(-1, -2))  # [B, Hkv, G, keys], scaled
        if bias is not None:
            n0 = c * bs + lo - start
            s.add_(bias[:, None, None, n0 : n0 + hi - lo])
        m_chunk = s.amax(dim=-1)
        if m_run is None:
            # Finite floor: a row that has seen only masked keys keeps m = -1e30, p = 0, l = 0 (no NaN).
            m_new = m_chunk.clamp_(min=-1.0e30)
        else:
            m_new = torch.maximum(m_run, m_chunk)
        p = s.sub_(m_new[..., None]).exp2_()
        pv = torch.matmul(p, vc.to(torch.float32))
        if m_run is None:
            l_run, acc = p.sum(dim=-1), pv
        else:
            alpha = torch.exp2(m_run - m_new)
            l_run = l_run.mul_(alpha).add_(p.sum(dim=-1))
            acc = acc.mul_(alpha[..., None]).add_(pv)
        m_run = m_new
    # Every key masked: acc and l are both 0; output zeros instead of 0/0.
    out = acc.div_(torch.where(l_run > 0, l_run, 1.0)[..., None])
    return out.reshape(B, Hq, Dv).to(q.dtype)


# ---------------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------------


def paged_store_torch(k_pool, v_pool, keys, values, slot_mapping, *, check: bool = True) -> None:
    """Plain-torch twin of the store: one index_put per pool; rejects slots outside the pool.

    ``check=False`` reads no slot value: every slot must be in 0..num_blocks*block_size-1 (no -1, which
    would land in the last block), and the rows are written straight through with no skip.
    """
    if not check:
        B, n, bs, _ = _store_dims(k_pool, keys)
        if B * n:
            _store_rows(k_pool, v_pool, keys, values, slot_mapping.reshape(-1), None, B, n, bs)
        return
    B, n, bs, nb = _check_store_inputs(k_pool, v_pool, keys, values, slot_mapping)
    if B * n == 0:
        return
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < -1 or hi >= nb * bs:
        bad = lo if lo < -1 else hi
        raise ShapeError(
            f"slot {bad} is outside the pool: slots are 0..{nb * bs - 1} ({nb} blocks x {bs}), -1 = skip"
        )
    flat = slot_mapping.reshape(-1)
    if lo == -1:
        take = (flat >= 0).nonzero().squeeze(1)
        flat = flat[take]
    else:
        take = None
    _store_rows(k_pool, v_pool, keys, values, flat, take, B, n, bs)


def _store_rows(k_pool, v_pool, keys, values, flat, take, B, n, bs) -> None:
    """Write token rows (index ``take`` of the (b, i) rows, or all) to slots ``flat`` (int64, in the pool)."""
    blocks, offsets = flat // bs, flat % bs
    for pool, src in ((k_pool, keys), (v_pool, values)):
        rows = src.transpose(1, 2).reshape(B * n, src.shape[1], src.shape[3])  # [(b, i), Hkv, dim]
        if take is not None:
            rows = rows.index_select(0, take)
        # Advanced indices on dims 0 and 2 around a slice: pool[blocks, :, offsets] is [K, Hkv, dim].
        pool[blocks, :, offsets] = rows


def paged_store_triton(k_pool, v_pool, keys, values, slot_mapping, *, check: bool = True) -> None:
    """Triton store (CUDA tensors, or any tensors under TRITON_INTERPRET=1): a bit-exact copy.

    One program per (tile of STORE_BLOCK_T tokens, batch row, KV head) copies the K and V rows of its
    tokens. Slots outside 0..num_blocks*block_size-1 (-1 = skip) are not written.
    """
    if check:
        _check_triton("paged_store_triton")
        B, n, bs, nb = _check_store_inputs(k_pool, v_pool, keys, values, slot_mapping)
        _check_runnable("paged_store_triton", k_pool.device)
    else:
        B, n, bs, nb = _store_dims(k_pool, keys)
    if B * n == 0:
        return
    # Copy raw bits (same element size, any strides): no float conversion, exact for every dtype.
    bits = torch.int32 if k_pool.element_size() == 4 else torch.int16
    kp, vp, ks, vs = (t.view(bits) for t in (k_pool, v_pool, keys, values))
    Hkv, D, Dv = k_pool.shape[1], k_pool.shape[3], v_pool.shape[3]
    grid = (triton.cdiv(n, STORE_BLOCK_T), B, Hkv)  # token tiles first: grid dims 1 and 2 stop at 65535
    _paged_store_kernel[grid](
        ks, vs, kp, vp, slot_mapping,
        n, D, Dv, nb * bs,
        ks.stride(0), ks.stride(1), ks.stride(2), ks.stride(3),
        vs.stride(0), vs.stride(1), vs.stride(2), vs.stride(3),
        kp.stride(0), kp.stride(1), kp.stride(2), kp.stride(3),
        vp.stride(0), vp.stride(1), vp.stride(2), vp.stride(3),
        slot_mapping.stride(0), slot_mapping.stride(1),
        BLOCK_SIZE=bs, BLOCK_T=STORE_BLOCK_T,
        D_PAD=max(16, triton.next_power_of_2(D)), DV_PAD=max(16, triton.next_power_of_2(Dv)),
        num_warps=4,
    )


if triton is not None:

    @triton.jit
    def _paged_store_kernel(
        Ks, Vs, KP, VP, Slots,
        N, D, DV, NUM_SLOTS,
        stride_ksb, stride_ksh, stride_ksn, stride_ksd,
        stride_vsb, stride_vsh, stride_vsn, stride_vsd,
        stride_kpb, stride_kph, stride_kpo, stride_kpd,
        stride_vpb, stride_vph, stride_vpo, stride_vpd,
        stride_smb, stride_smn,
        BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        pid_b = tl.program_id(1).to(tl.int64)
        pid_h = tl.program_id(2).to(tl.int64)
        offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = offs_t < N
        slot = tl.load(Slots + pid_b * stride_smb + offs_t * stride_smn, mask=t_ok, other=-1)
        ok = t_ok & (slot >= 0) & (slot < NUM_SLOTS)
        slot = tl.where(ok, slot, 0)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE

        # Row i of the tile: source token offs_t[i] of (pid_b, pid_h); target block blk[i], offset off[i].
        offs_d = tl.arange(0, D_PAD)
        m = ok[:, None] & (offs_d < D)[None, :]
        src = Ks + pid_b * stride_ksb + pid_h * stride_ksh + offs_t[:, None] * stride_ksn
        dst = KP + blk[:, None] * stride_kpb + pid_h * stride_kph + off[:, None] * stride_kpo
        x = tl.load(src + offs_d[None, :] * stride_ksd, mask=m, other=0)
        tl.store(dst + offs_d[None, :] * stride_kpd, x, mask=m)

        offs_dv = tl.arange(0, DV_PAD)
        m = ok[:, None] & (offs_dv < DV)[None, :]
        src = Vs + pid_b * stride_vsb + pid_h * stride_vsh + offs_t[:, None] * stride_vsn
        dst = VP + blk[:, None] * stride_vpb + pid_h * stride_vph + off[:, None] * stride_vpo
        x = tl.load(src + offs_dv[None, :] * stride_vsd, mask=m, other=0)
        tl.store(dst + offs_dv[None, :] * stride_vpd, x, mask=m)
