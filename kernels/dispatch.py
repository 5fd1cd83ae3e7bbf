"""The kernels' entry points: each call picks where it runs, and the callers (storages, attention) import them here.

Why a module of its own: the device choice names ``custom_ops``, which imports every kernel module. Made here,
above both, the kernel modules (the Triton kernels beside their torch twins) import nothing above them, and the
choice is one helper, :func:`_path`, that every entry point calls:

- while ``torch.compile`` (or ``torch.export``) traces a call with ``check=False`` on CUDA tensors: the torch
  custom operator of ``custom_ops`` (the paged store: on every device), one opaque node running the same kernel;
- CUDA tensors: the Triton kernel;
- everything else: on the CPU the C++ operators where they are built (a rotated format's, ``rotated_cpu``; KIVI codes
  and paged blocks, ``kivi_cpu``; traced, each is one external call), else the plain-torch twin, which a compiled
  graph traces inline.

Each entry point keeps the contract of its kernel module (shapes, ``check``, errors): ``decode_attention``,
``paged_attention``, ``quant_attention`` and ``quant_pack`` document it. The entry points run on every decode step
of every layer: no validation beyond ``check``'s, no tensor value read on the host, and traced with no graph break.
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels import (
    builtin_kernels,  # noqa: F401 - registers the built-in formats' kernels
    custom_ops,
    kivi_cpu,
    rotated_cpu,
)
from hf_kvplus.kernels.decode_attention import (
    _check_inputs,
    _check_num_splits,
    decode_attention_torch,
    decode_attention_triton,
    decode_attention_with_mass_torch,
    decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.format_kernels import check_used_blocks, path_of
from hf_kvplus.kernels.kv_format import kernels_for
from hf_kvplus.kernels.paged_attention import (
    _check_attention_inputs,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_store_torch,
    paged_store_triton,
)

__all__ = [
    "decode_attention",
    "paged_decode_attention",
    "paged_store",
    "paged_store_token",
    "prepare",
    "quantize_keys",
    "quantize_values",
    "quantize_values_at",
    "quantize_kv_into",
    "quantize_values_into",
    "quantized_decode_attention",
    "takes_values_into",
]


def prepare(fmt, key_dim: int, value_dim: int, device) -> None:
    """Everything a layer's format needs on `device`, made where shapes become fixed (a layer's first call): its
    tables (``fmt.prepare``) and, on the CPU, the C++ operators (built on first use), so that neither
    a decode step nor a graph compiled later makes them."""
    fmt.prepare(key_dim, value_dim, device)
    kernels_for(fmt)  # found now: a compiled step finds it cached
    if torch.device(device).type == "cpu":
        rotated_cpu.available()


# ---------------------------------------------------------------------------------------------------
# Dense decode attention
# ---------------------------------------------------------------------------------------------------


def decode_attention(
    q, k, v, *, scale, mask=None, num_splits=None, with_mass: bool = False, check: bool = True
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention; CUDA tensors run the Triton kernel, other devices the torch twin (a mass-reporting eager CPU
    call the C++ operator, `kivi_cpu.dense_decode_cpu`: K/V read in place, where the twin copies them to get the
    weights out; without the mass the operator measured faster alone and slower in real steps). `with_mass`: returns
    `(out, mass)`, each key's attention mass [B, Hkv, N] float32 too (what a scored eviction ranks by).

    ``num_splits`` only affects the Triton path (None = automatic, see ``decode_attention.pick_num_splits``).
    ``check=False``: the caller guarantees the contract (see ``decode_attention``'s module docstring).
    """
    path = path_of(q, check)
    if path == "op":
        op = custom_ops.decode_attention_with_mass if with_mass else custom_ops.decode_attention
        return op(q, k, v, scale, mask, num_splits)
    if path == "triton":
        fn = decode_attention_with_mass_triton if with_mass else decode_attention_triton
        return fn(q, k, v, scale=scale, mask=mask, num_splits=num_splits, check=check)
    if check:
        _check_num_splits(num_splits)
    if with_mass and path == "twin" and kivi_cpu.supports(q) and k.dtype in kivi_cpu.FLOATS:  # K/V read in place
        if check:
            _check_inputs(q, k, v, scale, mask, None)
        out, mass = kivi_cpu.dense_decode_cpu(q, k, v, scale, mask, True)
        return (out if out.dtype == q.dtype else out.to(q.dtype)), mass
    fn = decode_attention_with_mass_torch if with_mass else decode_attention_torch
    return fn(q, k, v, scale=scale, mask=mask, check=check)


# ---------------------------------------------------------------------------------------------------
# Paged decode attention and store
# ---------------------------------------------------------------------------------------------------


def paged_decode_attention(
    q, k_pool, v_pool, block_table, *, start, length, scale, mask=None, num_splits=None, check: bool = True
) -> torch.Tensor:
    """Paged decode attention; CUDA tensors run the Triton kernel, other devices the torch twin.

    ``num_splits`` only affects the Triton path (None = automatic, see ``pick_num_splits``).
    ``check=False``: the caller guarantees the contract (see ``paged_attention``'s module docstring).
    """
    if kivi_cpu.supports(q):
        if check:
            _check_attention_inputs(q, k_pool, v_pool, block_table, start, length, scale, mask, num_splits)
            check_used_blocks(block_table, k_pool.shape[0], k_pool.shape[2], start, length)
        out = kivi_cpu.paged_decode_cpu(q, k_pool, v_pool, block_table, start, length, scale, mask)
        return out if out.dtype == q.dtype else out.to(q.dtype)
    path = path_of(q, check)
    if path == "op":
        return custom_ops.paged_decode_attention(
            q, k_pool, v_pool, block_table, start, length, scale, mask, num_splits
        )
    if path == "triton":
        return paged_decode_attention_triton(
            q, k_pool, v_pool, block_table, start=start, length=length, scale=scale, mask=mask,
            num_splits=num_splits, check=check,
        )  # fmt: skip
    if check:
        _check_num_splits(num_splits)
    return paged_decode_attention_torch(
        q, k_pool, v_pool, block_table, start=start, length=length, scale=scale, mask=mask, check=check
    )


def paged_store_token(k_pool, v_pool, keys, values, offset: int, block_table, column: int) -> None:
    """A decode step's keys and values [B, Hkv, 1, D] written at `offset` of the blocks that column `column` of
    `block_table` [B, columns] names in the pools (the caller's table and offset: unchecked). Eager CPU steps take one
    C++ call for both sides (`kivi_cpu.write_token_cpu`), where indexing took two `index_put` calls; elsewhere the
    indexing, which a compiled graph traces and autograd records (the operator's copy has no backward: a step in grad
    mode indexes). (A dense buffer's slice assignments measured no slower than this call.)"""
    if (path_of(keys, False) == "twin" and kivi_cpu.supports(keys) and k_pool.is_cpu and v_pool.is_cpu
            and not (keys.requires_grad or values.requires_grad or k_pool.requires_grad or v_pool.requires_grad)
            and keys.dtype == k_pool.dtype and values.dtype == v_pool.dtype
            and k_pool.stride(-1) == v_pool.stride(-1) == keys.stride(-1) == values.stride(-1) == 1):  # fmt: skip
        kivi_cpu.write_token_cpu(k_pool, v_pool, keys, values, offset, block_table, column)
    else:
        # The offset through `select`, not an index: traced, an int index beside a tensor one specialized it, and the
        # step compiled anew at each offset of a block.
        blocks = (block_table[:, column],)
        k_pool.select(2, offset).index_put_(blocks, keys[:, :, 0])
        v_pool.select(2, offset).index_put_(blocks, values[:, :, 0])


def paged_store(k_pool, v_pool, keys, values, slot_mapping, *, check: bool = True) -> None:
    """Write new K/V into their pool slots in place; CUDA tensors run Triton, others the torch twin (traced with
    ``check=False``: the custom operator, on every device).

    ``check=False``: the caller guarantees the contract, every slot in 0..num_blocks*block_size-1
    (no -1; see ``paged_attention``'s module docstring).
    """
    path = path_of(k_pool, check, True)
    if path == "op":
        custom_ops.paged_store(k_pool, v_pool, keys, values, slot_mapping)
    elif path == "triton":
        paged_store_triton(k_pool, v_pool, keys, values, slot_mapping, check=check)
    else:
        paged_store_torch(k_pool, v_pool, keys, values, slot_mapping, check=check)


# ---------------------------------------------------------------------------------------------------
# Quantized decode attention
# ---------------------------------------------------------------------------------------------------


def quantized_decode_attention(
    q,
    packed,
    fmt,
    *,
    start,
    length,
    scale,
    residual_k=None,
    residual_v=None,
    mask=None,
    block_table=None,
    num_splits=None,
    keys_per_token: bool = False,
    with_mass: bool = False,
    check: bool = True,
    state=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over quantized K/V (+ residual); CUDA tensors run Triton, others the torch twin.
    `with_mass`: returns `(out, mass)`, each key's attention mass [B, Hkv, length + R] float32 too (quantized keys,
    then the residual). `state`: the layer's state of the format (a rotated format's key centre), or None.

    ``check=False``: the caller guarantees the contract (see ``quant_attention``'s module docstring).
    """
    kw = dict(
        start=start, length=length, scale=scale, residual_k=residual_k, residual_v=residual_v, mask=mask,
        block_table=block_table, num_splits=num_splits, keys_per_token=keys_per_token, check=check, state=state,
    )  # fmt: skip
    return kernels_for(fmt).attend(q, packed, fmt, kw, with_mass)  # the format's registered kernels


# ---------------------------------------------------------------------------------------------------
# Quantize and pack
# ---------------------------------------------------------------------------------------------------


def quantize_keys(x, fmt, out=None, *, check: bool = True, index: int | torch.Tensor = 0, state=None):
    """Keys [..., T, D] to (codes, scale, zero); CUDA tensors run the Triton kernel, others the torch twin.

    The Triton path needs 4-d keys [B, H, T, D]; the twin takes any leading dims. With ``out`` given the
    results are written into it (see ``quant_pack``'s module doc) and ``out``'s tensors are returned.
    ``check=False``: the caller guarantees the contract (see ``quant_pack``'s module doc). `index`: the buffer index
    of x's first token (an int, or a 0-d tensor on x's device: no sync), for a format whose key codes depend on it (a
    turning key centre, ``kernels/turning_center.py``). `state`: the layer's state of the format (a rotated format's
    key centre, set by the first keys coded), or None.
    """
    kernels = kernels_for(fmt)  # (a non-format refused here; what is not a tensor, by the kernels' checks)
    positions = fmt.key_positions(index, x.shape[-2], x.device, state) if fmt.indexed_keys(state) else None
    return kernels.quantize(x, fmt, out, "keys", check, positions, state)


def quantize_values(x, fmt, out=None, *, check: bool = True, state=None):
    """Values [..., T, D] to (codes, scale, zero); CUDA tensors run the Triton kernel, others the torch twin.

    The Triton path needs 4-d values [B, H, T, D]; the twin takes any leading dims. With ``out`` given the
    results are written into it (see ``quant_pack``'s module doc) and ``out``'s tensors are returned.
    ``check=False``: the caller guarantees the contract (see ``quant_pack``'s module doc). `state`: the layer's state
    where the values side codes keys (an evicting cache's slots), else None.
    """
    return kernels_for(fmt).quantize(x, fmt, out, "values", check, None, state)


def quantize_values_at(x, fmt, out, slots, *, check: bool = True, state=None):
    """Values x [B, H, T, D] quantized per token (as :func:`quantize_values`) straight into rows ``slots``
    (int64 [B, H, T]) of ``out`` = (codes [B, H, N, P], scale, zero [B, H, N, D // G]; zero None for fp8; any
    strides): token t of row b and head h lands in row ``slots[b, h, t]``, every other row untouched. What a
    storage that refills single slots writes per decode step (an evicting cache's hole), one launch where
    quantizing then scattering each of the three tensors would be four. Slots must be distinct per (b, h) and
    in 0..N-1 (``check`` validates shapes, dtypes and devices, not the values: reading them would sync).
    CUDA tensors run the Triton kernel, others the twin (quantize, then ``scatter_``); returns ``out`` (`state`: as
    :func:`quantize_values`)."""
    return kernels_for(fmt).quantize_at(x, fmt, out, slots, check, state)


def takes_values_into(x, fmt, state=None) -> bool:
    """Whether :func:`quantize_values_into` codes `x` in `fmt` (with the layer's `state`) here: KIVI or rotated codes
    of CPU floats in an eager call, with the C++ operators built (a rotated format's key centre set and not turning);
    elsewhere the caller guards and codes with :func:`quantize_values` and its ``out``."""
    return kernels_for(fmt).codes_into(x, state)


def quantize_values_into(x, fmt, out, start: int = 0, slots=None, *, limit=None, bad=None, state=None) -> None:
    """Values x [B, H, T, D] coded per token (as :func:`quantize_values`, bit for bit) straight into ``out`` =
    (codes, scale, zero or None) [B, H, N, ...] at rows ``start ..`` (or ``slots`` [B, H, T] int64), where
    :func:`takes_values_into` says so. With ``limit``, a value of larger magnitude (or NaN; for a format whose codes
    bound each vector's norm, `KVFormat.code_limit`, a vector of larger length) is coded as 0 and counted into ``bad``
    (0-d int64), as ``RangeGuard`` does before coding: one operator call where guarding, coding and copying into the
    slots' views took a dozen tensor operations (an evicting cache's decode step, every layer). `state`: as
    :func:`quantize_values`."""
    kernels_for(fmt).encode_into(x, fmt, out, start, slots, limit, bad, state)


def quantize_kv_into(k, v, fmts, out_k, out_v, start: int = 0, slots=None, *, limit=None, bad=None, state=None) -> None:
    """:func:`quantize_values_into` of a token's keys `k` in ``fmts[0]`` (with the layer's `state`) into ``out_k`` and
    its values `v` in ``fmts[1]`` into ``out_v``, at the same rows, where :func:`takes_values_into` says so for both:
    one operator call where the keys' format's kernels code both sides (an evicting cache's decode step, every
    layer), else one per side."""
    kernels_for(fmts[0]).encode_kv_into(k, v, fmts, out_k, out_v, start, slots, limit, bad, state)
