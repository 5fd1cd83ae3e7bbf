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

from hf_kvplus.kernels import custom_ops, kivi_cpu, rotated_cpu
from hf_kvplus.kernels.decode_attention import (
    _check_num_splits,
    decode_attention_torch,
    decode_attention_triton,
    decode_attention_with_mass_torch,
    decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.errors import ShapeError
from hf_kvplus.kernels.paged_attention import (
    _check_attention_inputs,
    _check_block_ids,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_store_torch,
    paged_store_triton,
)
from hf_kvplus.kernels.quant_attention import (
    _check_inputs,
    _twin,
    quantized_decode_attention_triton,
    quantized_decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.quant_pack import (
    _check_at,
    _new_out,
    quantize_keys_triton,
    quantize_off_cuda,
    quantize_values_at_torch,
    quantize_values_at_triton,
    quantize_values_triton,
)
from hf_kvplus.kernels.rotated_attention import rotated_decode_attention_triton
from hf_kvplus.kernels.rotated_format import RotatedFormat, rotation, turning_key_center
from hf_kvplus.kernels.rotated_pack import quantize_rotated_triton

__all__ = [
    "decode_attention",
    "paged_decode_attention",
    "paged_store",
    "prepare",
    "quantize_keys",
    "quantize_values",
    "quantize_values_at",
    "quantized_decode_attention",
]


def _path(x, check: bool, op_off_cuda: bool = False) -> str:
    """Where a call on `x` runs, the one place kernels/ asks whether the compiler is tracing: "op" (the custom
    operator: an unchecked call being traced, on CUDA unless `op_off_cuda`), "triton" (CUDA tensors), "traced" (the
    twin, traced off CUDA: it takes the forms inductor fuses) or "twin" (everything else, a checked call's non-tensor
    included, which the twin's checks refuse)."""
    cuda = (not check or isinstance(x, torch.Tensor)) and x.is_cuda
    if not torch.compiler.is_compiling():
        return "triton" if cuda else "twin"
    if not check and (cuda or op_off_cuda):
        return "op"
    return "triton" if cuda else "traced"


#: The paths that run the torch twin.
_TWINS = ("twin", "traced")


def prepare(fmt, key_dim: int, value_dim: int, device) -> None:
    """Everything a layer's format needs on `device`, made where shapes become fixed (a layer's first call): its
    tables (``fmt.prepare``) and, on the CPU, the C++ operators (built on first use), so that neither
    a decode step nor a graph compiled later makes them."""
    fmt.prepare(key_dim, value_dim, device)
    if torch.device(device).type == "cpu":
        rotated_cpu.available()


# ---------------------------------------------------------------------------------------------------
# Dense decode attention
# ---------------------------------------------------------------------------------------------------


def decode_attention(
    q, k, v, *, scale, mask=None, num_splits=None, with_mass: bool = False, check: bool = True
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention; CUDA tensors run the Triton kernel, other devices the torch twin. `with_mass`: returns
    `(out, mass)`, each key's attention mass [B, Hkv, N] float32 too (what a scored eviction ranks by).

    ``num_splits`` only affects the Triton path (None = automatic, see ``decode_attention.pick_num_splits``).
    ``check=False``: the caller guarantees the contract (see ``decode_attention``'s module docstring).
    """
    path = _path(q, check)
    if path == "op":
        op = custom_ops.decode_attention_with_mass if with_mass else custom_ops.decode_attention
        return op(q, k, v, scale, mask, num_splits)
    if path == "triton":
        fn = decode_attention_with_mass_triton if with_mass else decode_attention_triton
        return fn(q, k, v, scale=scale, mask=mask, num_splits=num_splits, check=check)
    if check:
        _check_num_splits(num_splits)
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
            _check_used_blocks(block_table, k_pool.shape[0], k_pool.shape[2], start, length)
        out = kivi_cpu.paged_decode_cpu(q, k_pool, v_pool, block_table, start, length, scale, mask)
        return out.to(q.dtype)
    path = _path(q, check)
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


def paged_store(k_pool, v_pool, keys, values, slot_mapping, *, check: bool = True) -> None:
    """Write new K/V into their pool slots in place; CUDA tensors run Triton, others the torch twin (traced with
    ``check=False``: the custom operator, on every device).

    ``check=False``: the caller guarantees the contract, every slot in 0..num_blocks*block_size-1
    (no -1; see ``paged_attention``'s module docstring).
    """
    path = _path(k_pool, check, True)
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over quantized K/V (+ residual); CUDA tensors run Triton, others the torch twin.
    `with_mass`: returns `(out, mass)`, each key's attention mass [B, Hkv, length + R] float32 too (quantized keys,
    then the residual).

    ``check=False``: the caller guarantees the contract (see ``quant_attention``'s module docstring).
    """
    kw = dict(
        start=start, length=length, scale=scale, residual_k=residual_k, residual_v=residual_v, mask=mask,
        block_table=block_table, num_splits=num_splits, keys_per_token=keys_per_token, check=check,
    )  # fmt: skip
    return _quantized(q, packed, fmt, kw, with_mass)


def _quantized(q, packed, fmt, kw: dict, with_mass: bool):
    """A rotated format through :func:`_rotated`, else the path of :func:`_path`."""
    if isinstance(fmt, RotatedFormat):
        return _rotated(q, packed, fmt, kw, with_mass)
    if kivi_cpu.supports(q):
        return _kivi_cpu(q, packed, fmt, kw, with_mass)
    path = _path(q, kw["check"])
    if path == "op":
        p, args = packed, [kw[k] for k in ("start", "length", "scale", "residual_k", "residual_v", "mask")]
        op = custom_ops.quantized_decode_attention_with_mass if with_mass else custom_ops.quantized_decode_attention
        return op(
            q, p.k, p.k_scale, p.k_zero, p.v, p.v_scale, p.v_zero, *custom_ops.format_args(fmt), *args,
            kw["block_table"], kw["num_splits"], kw["keys_per_token"],
        )  # fmt: skip
    if path == "triton":
        fn = quantized_decode_attention_with_mass_triton if with_mass else quantized_decode_attention_triton
        return fn(q, packed, fmt, **kw)
    result = _twin(q, packed, fmt, *(kw[k] for k in _TWIN_ARGS), with_mass=with_mass, planes=path == "traced")
    return result if with_mass else result[0]


def _rotated(q, packed, fmt, kw: dict, with_mass: bool):
    """A rotated format's attention, computed in the rotated space: q and the residual rotated in (float32; q . k
    and the softmax are unchanged by an orthogonal rotation; a residual of a format with `inputs_rotated` comes
    rotated), the codes read as they are, the output (a weighted sum of rotated values) rotated back once."""
    D, kw = q.shape[-1], dict(kw)
    if kw["check"] and (not isinstance(q, torch.Tensor) or q.dim() != 3):
        raise ShapeError(f"q must be a 3-d tensor [B, Hq, D], got {getattr(q, 'shape', type(q).__name__)}")
    Dv = fmt.channels(packed.v.shape[-1], "values")
    if rotated_cpu.supports(q, fmt, kw["block_table"]):
        return _rotated_cpu(q, packed, fmt, kw, with_mass)
    # Compiled off CUDA the twin decodes the codes in plane order (`rotated_format.decoded_planes`), which inductor
    # vectorizes: a permutation of the channels shared by q, the keys, the values and the rotation back leaves the
    # output unchanged, so the rotations' columns are permuted to match.
    path = _path(q, kw["check"])
    planes = path == "traced"
    # A ring held rotated stays in channel order: the twin folds it in after the codes, with q and the running output
    # turned to channel order (a few floats), where putting the ring in plane order copied all of it every step.
    ring_in_channels = planes and kw["residual_k"] is not None and fmt.inputs_rotated
    r_k = rotation(D, fmt.seed, q.device, plane_bits=fmt.key_bits if planes else None)
    r_v = rotation(Dv, fmt.seed, q.device, plane_bits=fmt.value_bits if planes and not ring_in_channels else None)
    if kw["residual_k"] is not None and fmt.inputs_rotated:
        kw["residual_k"], kw["residual_v"] = kw["residual_k"].float(), kw["residual_v"].float()
    elif kw["residual_k"] is not None:
        kw["residual_k"], kw["residual_v"] = kw["residual_k"].float() @ r_k, kw["residual_v"].float() @ r_v
    q_rot = q.float() @ r_k
    if path == "op":
        p = packed
        op = custom_ops.rotated_decode_attention_with_mass if with_mass else custom_ops.rotated_decode_attention
        center, turning = fmt.key_center, turning_key_center(fmt)
        turn = (None, None)
        if turning is not None and turning.mu is not None:  # the query's weights and the basis rows of the codes
            turn = turning.query_weights(q_rot, rotated=True), turning.basis(kw["start"] + kw["length"], q.device)
        result = op(
            q_rot, p.k, p.k_scale, p.v, p.v_scale, fmt.key_bits, fmt.value_bits, fmt.seed,
            *(kw[k] for k in ("start", "length", "scale", "residual_k", "residual_v", "mask", "block_table", "num_splits")),
            None if center is None or turning is not None else center.rotated, *turn,
        )  # fmt: skip
        result = result if with_mass else (result, None)
    elif path == "triton":
        result = rotated_decode_attention_triton(q_rot, packed, fmt, **kw, with_mass=with_mass)
    else:
        result = _twin(q_rot, packed, fmt, *(kw[k] for k in _TWIN_ARGS), with_mass=with_mass, planes=planes,
                       ring_in_channels=ring_in_channels)  # fmt: skip
    out = (result[0] @ r_v.T).to(q.dtype)
    return (out, result[1]) if with_mass else out


def _rotated_cpu(q, packed, fmt, kw: dict, with_mass: bool):
    """:func:`_rotated` through the CPU operator (`rotated_cpu`), which rotates q and the output itself."""
    if kw["check"]:
        _check_inputs(q, packed, fmt, *(kw[k] for k in _TWIN_ARGS[:-1]))
    out, mass = rotated_cpu.rotated_decode_cpu(
        q, packed, fmt, kw["start"], kw["length"], kw["scale"], kw["residual_k"], kw["residual_v"], kw["mask"],
        with_mass,
    )  # fmt: skip
    out = out.to(q.dtype)
    return (out, mass) if with_mass else out


def _kivi_cpu(q, packed, fmt, kw: dict, with_mass: bool):
    """:func:`_quantized` of a KIVI format through the CPU operator (`kivi_cpu`)."""
    if kw["check"]:
        info = _check_inputs(q, packed, fmt, *(kw[k] for k in _TWIN_ARGS[:-1]))
        if info.paged and kw["length"] > 0:
            _check_used_blocks(kw["block_table"], info.num_blocks, info.T, kw["start"], kw["length"])
    out, mass = kivi_cpu.kivi_decode_cpu(
        q, packed, fmt, *(kw[k] for k in ("start", "length", "scale", "residual_k", "residual_v", "mask",
                                          "block_table", "keys_per_token")), with_mass,
    )  # fmt: skip
    out = out.to(q.dtype)
    return (out, mass) if with_mass else out


def _check_used_blocks(block_table, num_blocks: int, block_size: int, start: int, length: int) -> None:
    """The block ids of the table columns tokens `start .. start + length - 1` use are in the pool (a host read, as
    the twins' check makes): the operators read them unchecked."""
    if length > 0:
        first, end = start // block_size, (start + length - 1) // block_size + 1
        _check_block_ids(block_table[:, first:end], num_blocks, first, end, start, length)


#: The twin's positional arguments after (q, packed, fmt), by keyword name.
_TWIN_ARGS = (
    "start", "length", "scale", "residual_k", "residual_v", "mask", "block_table", "num_splits", "keys_per_token",
    "check",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Quantize and pack
# ---------------------------------------------------------------------------------------------------


def quantize_keys(x, fmt, out=None, *, check: bool = True, index: int | torch.Tensor = 0):
    """Keys [..., T, D] to (codes, scale, zero); CUDA tensors run the Triton kernel, others the torch twin.

    The Triton path needs 4-d keys [B, H, T, D]; the twin takes any leading dims. With ``out`` given the
    results are written into it (see ``quant_pack``'s module doc) and ``out``'s tensors are returned.
    ``check=False``: the caller guarantees the contract (see ``quant_pack``'s module doc). `index`: the buffer index
    of x's first token (an int, or a 0-d tensor on x's device: no sync), where a turning key centre
    (``kernels/turning_center.py``) codes it.
    """
    turning = turning_key_center(fmt) is not None
    positions = index + torch.arange(x.shape[-2], device=x.device) if turning else None
    return _quantize(x, fmt, out, "keys", check, positions)


def quantize_values(x, fmt, out=None, *, check: bool = True):
    """Values [..., T, D] to (codes, scale, zero); CUDA tensors run the Triton kernel, others the torch twin.

    The Triton path needs 4-d values [B, H, T, D]; the twin takes any leading dims. With ``out`` given the
    results are written into it (see ``quant_pack``'s module doc) and ``out``'s tensors are returned.
    ``check=False``: the caller guarantees the contract (see ``quant_pack``'s module doc).
    """
    return _quantize(x, fmt, out, "values", check)


def _quantize(x, fmt, out, kind: str, check: bool, positions=None):
    """Both quantize entry points: off CUDA ``quant_pack.quantize_off_cuda``; a rotated format on CUDA through
    :func:`_rotated_cuda`; else the custom operator (writing into `out`, or into tensors allocated first) or Triton."""
    path = _path(x, check)
    if path in _TWINS:
        return quantize_off_cuda(x, fmt, out, kind, check, positions)
    if isinstance(fmt, RotatedFormat):
        return _rotated_cuda(x, fmt, out, kind, None, path, check, positions)
    if path == "op":
        codes, scale, zero = _new_out(kind, tuple(x.shape), fmt, x.device) if out is None else out
        op = custom_ops.quantize_keys if kind == "keys" else custom_ops.quantize_values
        op(x, *custom_ops.format_args(fmt), codes, scale, zero)
        return codes, scale, zero
    return (quantize_keys_triton if kind == "keys" else quantize_values_triton)(x, fmt, out=out, check=check)


def quantize_values_at(x, fmt, out, slots, *, check: bool = True):
    """Values x [B, H, T, D] quantized per token (as :func:`quantize_values`) straight into rows ``slots``
    (int64 [B, H, T]) of ``out`` = (codes [B, H, N, P], scale, zero [B, H, N, D // G]; zero None for fp8; any
    strides): token t of row b and head h lands in row ``slots[b, h, t]``, every other row untouched. What a
    storage that refills single slots writes per decode step (an evicting cache's hole), one launch where
    quantizing then scattering each of the three tensors would be four. Slots must be distinct per (b, h) and
    in 0..N-1 (``check`` validates shapes, dtypes and devices, not the values: reading them would sync).
    CUDA tensors run the Triton kernel, others the twin (quantize, then ``scatter_``); returns ``out``."""
    path = _path(x, check)
    if path in _TWINS:
        if check:
            _check_at(x, fmt, out, slots)
        return quantize_values_at_torch(x, fmt, out, slots)
    if isinstance(fmt, RotatedFormat):
        return _rotated_cuda(x, fmt, out, "values", slots, path, check)
    if path == "op":
        custom_ops.quantize_values_at(x, *custom_ops.format_args(fmt), *out, slots)
        return out
    return quantize_values_at_triton(x, fmt, out, slots, check=check)


def _rotated_cuda(x, fmt: RotatedFormat, out, side: str, slots, path: str, check: bool, positions=None):
    """A rotated format on CUDA: the custom operator while compiling (``check=False``; a turning centre goes to it as the
    centre of each token), else the Triton kernel."""
    if path == "op":
        codes, norms, _ = _new_out(side, tuple(x.shape), fmt, x.device) if out is None else out
        center = fmt.center_of(side)
        if center is not None and not fmt.inputs_rotated:
            center.observe(x, fmt.seed, positions)  # the layer's first keys set its centre (once; see rotated_format)
        turning = turning_key_center(fmt) is not None and side == "keys"
        mu = None if center is None else center.at(positions, rotated=False) if turning else center.mu  # [H, (T,) D]
        custom_ops.quantize_rotated(
            x, fmt.key_bits, fmt.value_bits, fmt.seed, side, codes, norms, slots, mu, fmt.inputs_rotated
        )
        return codes, norms, None
    return quantize_rotated_triton(x, fmt, side, out, slots, check=check, positions=positions)
