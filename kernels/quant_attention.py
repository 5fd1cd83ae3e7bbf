"""Decode attention over quantized K/V, read in place: the codes are dequantized in registers.

One query token per batch row attends to a quantized segment (group-quantized codes with float16
scales/zeros, the layout of ``kernels/quant_format.py``) followed by an optional full-precision
residual (the most recent tokens, not yet quantized). No full-length dequantized K/V is ever made.

Entry points sharing one contract:

- ``quantized_decode_attention`` (``kernels/dispatch.py``) dispatches: CUDA tensors go to Triton, everything else
  to the plain-torch twin; a rotated format's attention runs in the rotated space (``rotated_attention`` on CUDA,
  the C++ operator of ``rotated_cpu`` on the CPU where it is built, else this module's twin).
- :func:`quantized_decode_attention_triton` is split-KV flash-decoding. Kernel 1 (``_quant_split_kernel``)
  walks one slice of the quantized tokens per (batch row, KV head, split) for the whole query group:
  it loads uint8 code tiles [BLOCK_N, P] and, per token and channel, the token's key scale/zero row
  (``t // group_size``) and value scale/zero column (``c // group_size``), unpacks the codes with
  shifts, dequantizes in float32 registers and runs the online softmax. The bit width (``BITS``,
  ``IS_FP8``) and the storage (``PAGED``) are compile-time switches. The residual, if any, runs
  ``decode_attention``'s split kernel on its own splits, writing its partials after the quantized
  ones into the same buffers; ``decode_attention``'s merge kernel combines all of them.
- :func:`quantized_decode_attention_torch` is the twin: it walks the quantized segment in chunks
  (``TWIN_CHUNK_TOKENS`` keys; whole key groups dense, whole blocks paged), dequantizes one chunk at
  a time with ``quant_format``'s functions, then the residual, merging with an online softmax in
  float32 (memory O(chunk), not O(length)).
- ``quantized_decode_attention_with_mass`` (twins :func:`..._with_mass_torch` and :func:`..._with_mass_triton`)
  also returns each key's attention mass per KV head, for heavy-hitter (H2O) eviction over quantized slots:
  mass [B, Hkv, length + R] float32, mass[b, j, n] the sum over KV head j's query group of the softmax
  weight of key n (quantized keys first, then the residual; zeros where masked and on a fully masked
  row). The Triton path turns on the split kernels' logit stores and the merge kernel's log-sum-exp, as
  ``decode_attention_with_mass_triton`` does; the twin keeps each chunk's logits.

Arguments. q [B, Hq, D] in float32, float16 or bfloat16; Hq % Hkv == 0 (query head h reads KV head
h // (Hq // Hkv)). ``packed`` is a :class:`PackedKV` in format ``fmt`` (``per = 8 // bits`` codes per
byte, fp8: 1; G = ``fmt.group_size``):

- dense (``block_table`` None): buffers k [B, Hkv, T, D // per], k_scale/k_zero [B, Hkv, T // G, D],
  v [B, Hkv, T, Dv // per], v_scale/v_zero [B, Hkv, T, Dv // G]; the keys attended are buffer tokens
  ``start .. start + length - 1`` (``start`` need not be group-aligned; every attended token's key
  group must lie inside the buffer: ``start + length <= (T // G) * G``).
- paged (``block_table`` int32 [B, columns]): pools with ``num_blocks`` in place of B and the block
  size ``bs`` (a multiple of G) in place of T (k_scale/k_zero [num_blocks, Hkv, bs // G, D]); logical
  token t of row b is in block ``block_table[b, t // bs]`` at offset ``t % bs``; tokens ``start ..
  start + length - 1`` are attended. Table columns those tokens do not use are never read. The Triton
  path treats a block id outside 0..num_blocks-1 in a column it reads as masked keys; the twin raises
  ShapeError.

Codes are uint8, scales and zeros float16, zeros None exactly for fp8; any strides.
``residual_k`` [B, Hkv, R, D] / ``residual_v`` [B, Hkv, R, Dv] (both or neither, q's dtype, any
strides) are attended after the quantized tokens. ``length`` may be 0 and the residual absent or
empty, but there must be at least one key. ``mask`` None or bool [B, length + R] (True = attend) over
[quantized..., residual...]; a row with every key masked outputs zeros. Output [B, Hq, Dv] in
q.dtype: softmax(q K^T * scale + mask) V with K, V the dequantized codes (``quant_format.dequantize_*``)
followed by the residual.

``num_splits`` (Triton only; None = automatic, see ``decode_attention.pick_num_splits``) cuts the
quantized segment and the residual each into at most that many slices (never an empty one).

``keys_per_token`` (keyword, every entry point): keys quantized like values, per token over groups of G
channels (``quant_format.quantize_values``): k_scale/k_zero [L, Hkv, T, D // G], and no key group spans
tokens, so ``start``/``length`` need not respect group bounds and a paged block size need not be a multiple
of G. The layout of storages that overwrite single tokens in place (an evicting cache's slots).

``check`` (keyword, every entry point; the dispatchers pass it on): True (the default) validates the whole
contract above. False skips all of it (types, shapes, dtypes, devices, format and range checks,
``num_splits``, whether Triton can run) and the twin's host read of the block ids it uses: sizes come
off the shapes only, and no path reads a tensor value on the host. For callers whose inputs are valid
by construction (the caches' storages), who guarantee every block id read is in 0..num_blocks-1.
Invalid input is undefined behaviour.
While ``torch.compile`` (or ``torch.export``) traces, a dispatcher called with ``check=False`` runs
one custom operator, ``torch.ops.kvplus.quantized_decode_attention`` (``kernels/custom_ops.py``), which
runs the same Triton kernel; off CUDA the twin is traced inline instead.
"""

from __future__ import annotations

import itertools

import torch

from hf_kvplus.kernels.decode_attention import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    SUPPORTED_DTYPES,
    _alloc_partials,
    _block_g,
    _check_mask_and_scale,
    _check_num_splits,
    _is_interpreted,
    _launch_split,
    _merge_partials,
    _plan_splits,
    decode_attention_with_mass_torch,
    grouped_sdpa,
)
from hf_kvplus.kernels.errors import ConfigError, DeviceError, DTypeError, KernelUnavailableError, ShapeError
from hf_kvplus.kernels.kv_format import KVFormat, state_kw
from hf_kvplus.kernels.paged_attention import _check_block_ids, _is_int
from hf_kvplus.kernels.quant_format import PackedKV
from hf_kvplus.kernels.rotated_format import from_plane_order

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twin still works without triton
    triton = None
    tl = None

__all__ = [
    "quantized_decode_attention_torch",
    "quantized_decode_attention_triton",
    "quantized_decode_attention_with_mass_torch",
    "quantized_decode_attention_with_mass_triton",
]

# Keys per chunk of the torch twin (rounded to whole key groups dense, whole blocks paged).
TWIN_CHUNK_TOKENS = 1024
#: Float32 tile elements per thread the split kernel's plan allows, for half-precision and float32 q.
REGISTER_FLOATS_HALF, REGISTER_FLOATS_FP32 = 90, 40
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


class _Info:
    """What validation learned: sizes, and for paged storage the block size and pool size."""

    __slots__ = ("B", "Hq", "Hkv", "G", "D", "Dv", "R", "T", "paged", "num_blocks")

    def __init__(self, **kw):
        for name, value in kw.items():
            setattr(self, name, value)


def _check_tensor(name, t, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ShapeError(f"{name} must have 4 dims, got {t.dim()} dims with shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise DTypeError(f"{name} dtype must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise DeviceError(f"{name} is on {t.device}, q on {device}")


def _check_inputs(
    q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits, keys_per_token=False
) -> _Info:
    """Validate the whole contract (shapes, dtypes, devices, ranges); see the module docstring."""
    if not isinstance(fmt, KVFormat):
        raise ConfigError(f"fmt must be a KVFormat (a QuantFormat, a RotatedFormat, ...), got {type(fmt).__name__}")
    if not isinstance(packed, PackedKV):
        raise DTypeError(f"packed must be a PackedKV, got {type(packed).__name__}")
    if not isinstance(q, torch.Tensor):
        raise DTypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ShapeError(f"q must have 3 dims ([B, Hq, D]), got {q.dim()} dims with shape {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(f"q dtype {q.dtype} is not supported; expected one of {SUPPORTED_DTYPES}")
    B, Hq, D = q.shape
    if B == 0 or Hq == 0:
        raise ShapeError(f"batch and head counts must be positive, got B={B}, Hq={Hq}")
    dev, G = q.device, fmt.group_size

    # Packed tensors: dtypes, devices, zeros present exactly for the integer formats.
    for name in ("k", "k_scale", "v", "v_scale"):
        want = torch.uint8 if name in ("k", "v") else torch.float16
        _check_tensor(name, getattr(packed, name), want, dev)
    for name in ("k_zero", "v_zero"):
        z = getattr(packed, name)
        if not fmt.has_zero and z is not None:
            raise ConfigError(f"format {fmt} has no zero points, but packed.{name} is a tensor")
        if fmt.has_zero:
            if z is None:
                raise ConfigError(f"format {fmt} needs zero points, but packed.{name} is None")
            _check_tensor(name, z, torch.float16, dev)

    # Shapes: [L, Hkv, T, ...] with L = B (dense) or num_blocks (paged), T = capacity or block size.
    L, Hkv, T, pk = packed.k.shape
    if Hkv == 0 or L == 0:
        raise ShapeError(
            f"packed.k must have at least one KV head and one row/block, got shape {list(packed.k.shape)}"
        )
    fmt.check_head_dim(D)
    if pk != fmt.code_dim(D, "keys"):
        raise ShapeError(
            f"packed.k holds {pk} bytes per token; head_dim D={D} in {fmt} needs {fmt.code_dim(D, 'keys')}"
        )
    Dv = fmt.channels(packed.v.shape[-1], "values")
    fmt.check_head_dim(Dv)
    for name, d in (("head_dim D", D), ("value head_dim Dv", Dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ShapeError(f"{name}={d} is not supported; expected {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    expected = {
        "k_scale": (L, Hkv, *fmt.param_shape("values" if keys_per_token else "keys", T, D)),
        "k_zero": (L, Hkv, *fmt.param_shape("values" if keys_per_token else "keys", T, D)),
        "v": (L, Hkv, T, fmt.code_dim(Dv, "values")),
        "v_scale": (L, Hkv, *fmt.param_shape("values", T, Dv)),
        "v_zero": (L, Hkv, *fmt.param_shape("values", T, Dv)),
    }
    for name, shape in expected.items():
        t = getattr(packed, name)
        if t is not None and tuple(t.shape) != shape:
            raise ShapeError(
                f"packed.{name} shape must be {list(shape)} (packed.k is {list(packed.k.shape)}, {fmt}, "
                f"D={D}, Dv={Dv}), got {list(t.shape)}"
            )
    if Hq % Hkv != 0:
        raise ShapeError(
            f"query heads Hq={Hq} must be a multiple of KV heads Hkv={Hkv} (remainder {Hq % Hkv})"
        )

    if not _is_int(start) or start < 0:
        raise ConfigError(f"start must be an int >= 0, got {start!r}")
    if not _is_int(length) or length < 0:
        raise ConfigError(f"length must be an int >= 0, got {length!r}")

    paged = block_table is not None
    if paged:
        if T % G and not keys_per_token:
            raise ConfigError(f"block_size {T} (pool dim 2) is not a multiple of the group size {G} ({fmt})")
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
        if block_table.device != dev:
            raise DeviceError(f"block_table is on {block_table.device}, q on {dev}")
        columns = block_table.shape[1]
        if start + length > columns * T:
            raise ShapeError(
                f"tokens {start}..{start + length - 1} (start={start}, length={length}) need "
                f"{(start + length - 1) // T + 1} table columns of block_size {T}; block_table has {columns} "
                f"columns ({columns * T} tokens)"
            )
    else:
        if L != B:
            raise ShapeError(f"batch size mismatch: q has B={B}, packed buffers have {L} rows")
        if start + length > T:
            raise ShapeError(
                f"tokens {start}..{start + length - 1} (start={start}, length={length}) are past the "
                f"buffer of T={T} tokens"
            )
        if start + length > (T // G) * G and not keys_per_token:
            raise ShapeError(
                f"tokens {start}..{start + length - 1} reach past the last whole key group: the buffer of "
                f"T={T} tokens has {T // G} key groups of {G} ({(T // G) * G} tokens)"
            )

    R = 0
    if (residual_k is None) != (residual_v is None):
        raise ConfigError("residual_k and residual_v must be given together (or both None)")
    if residual_k is not None:
        for name, t, d in (("residual_k", residual_k, D), ("residual_v", residual_v, Dv)):
            _check_tensor(name, t, q.dtype, dev)
            if t.shape[0] != B or t.shape[1] != Hkv or t.shape[3] != d:
                raise ShapeError(
                    f"{name} shape must be [B, Hkv, R, {'D' if d == D else 'Dv'}] = [{B}, {Hkv}, R, {d}], "
                    f"got {list(t.shape)}"
                )
        R = residual_k.shape[2]
        if residual_v.shape[2] != R:
            raise ShapeError(
                f"residual length mismatch: residual_k has R={R}, residual_v has {residual_v.shape[2]}"
            )
    if length + R == 0:
        raise ShapeError(f"no keys to attend to: length={length} quantized tokens and R={R} residual tokens")

    _check_mask_and_scale(mask, scale, (B, length + R), "[B, length + R]", dev, "q and the packed K/V")
    _check_num_splits(num_splits)
    return _dims(q, packed, fmt, residual_k, block_table)


def _dims(q, packed, fmt, residual_k, block_table) -> _Info:
    """The sizes of :class:`_Info` read off the shapes, no checks (``_check_inputs`` validates first)."""
    B, Hq, D = q.shape
    L, Hkv, T, _ = packed.k.shape
    R = 0 if residual_k is None else residual_k.shape[2]
    return _Info(
        B=B, Hq=Hq, Hkv=Hkv, G=Hq // Hkv, D=D, Dv=fmt.channels(packed.v.shape[-1], "values"), R=R, T=T,
        paged=block_table is not None, num_blocks=L,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------


def quantized_decode_attention_with_mass_triton(
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
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantized_decode_attention_triton` plus the mass: the split kernels store their logits and the
    merge kernel each row's log-sum-exp (log2 domain), as ``decode_attention_with_mass_triton`` does."""
    return _quant_triton(
        q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits,
        keys_per_token, check, with_mass=True,
    )  # fmt: skip


def quantized_decode_attention_triton(
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
    check: bool = True,
) -> torch.Tensor:
    """Split-KV flash-decoding over the codes in place (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    out, _ = _quant_triton(
        q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits,
        keys_per_token, check, with_mass=False,
    )  # fmt: skip
    return out


def _quant_triton(
    q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits, keys_per_token,
    check, *, with_mass,
):  # fmt: skip
    """The Triton path of both entry points: (output, mass or None)."""
    name = "quantized_decode_attention_with_mass_triton" if with_mass else "quantized_decode_attention_triton"
    if check:
        if triton is None:
            raise KernelUnavailableError(f"{name} needs triton, which is not installed")
        info = _check_inputs(
            q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits,
            keys_per_token,
        )
        if not q.is_cuda and not _is_interpreted(_quant_split_kernel):
            raise KernelUnavailableError(
                f"{name} needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 set before import; use "
                f"{name.removesuffix('_triton')}_torch"
            )
    else:
        info = _dims(q, packed, fmt, residual_k, block_table)

    def launch(q, partials, plan, scores):
        _launch_quant_split(
            q, packed, fmt, info, mask, partials, plan, scale, start, length, block_table, keys_per_token, scores
        )  # fmt: skip

    return split_decode(q, info, launch, length, scale, residual_k, residual_v, mask, num_splits, with_mass, q.dtype)


def split_decode(q, info, launch, length, scale, residual_k, residual_v, mask, num_splits, with_mass, out_dtype):
    """Split-KV decoding of a coded segment and the residual, shared by every coded format: ``launch(q, partials,
    plan, scores)`` runs kernel 1 over the `length` coded keys into splits 0 .. plan.num_splits - 1 (its format's
    kernel), the residual runs ``decode_attention``'s split kernel on the splits after them, and the merge kernel
    combines them. (output `out_dtype` [B, Hq, Dv], mass float32 [B, Hkv, length + R] or None)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    R, Dv = info.R, info.Dv
    quant_plan = _quant_plan(q, info, length, num_splits) if length > 0 else None
    res_plan = _plan_splits(q, info.Hkv, Dv, R, num_splits) if R > 0 else None
    s_quant = quant_plan.num_splits if quant_plan else 0
    partials = _alloc_partials(q, Dv, s_quant + (res_plan.num_splits if res_plan else 0))
    B, Hq = q.shape[:2]
    scores = torch.empty((B, Hq, length + R), dtype=torch.float32, device=q.device) if with_mass else None

    if quant_plan is not None:
        launch(q, partials, quant_plan, None if scores is None else scores[:, :, :length])
    if res_plan is not None:
        rk = residual_k if residual_k.stride(-1) == 1 else residual_k.contiguous()
        rv = residual_v if residual_v.stride(-1) == 1 else residual_v.contiguous()
        _launch_split(
            q, rk, rv, None if mask is None else mask[:, length:], partials, res_plan, scale=scale, n_keys=R,
            split_offset=s_quant, scores=None if scores is None else scores[:, :, length:],
        )  # fmt: skip
    dv_pad = max(16, triton.next_power_of_2(Dv))
    if scores is None:
        return _merge_partials(partials, out_dtype, dv_pad), None
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    out = _merge_partials(partials, out_dtype, dv_pad, lse=lse)
    return out, torch.exp2(scores - lse[..., None]).view(B, info.Hkv, info.G, -1).sum(dim=2)


def _quant_plan(q, info, n_keys, num_splits):
    """Tiles of the quantized kernel: BLOCK_N keys of float32 K/V plus their scales and zeros.

    The dequantized tiles cost more registers than the dense kernel's (codes, scale and zero tiles of
    [BLOCK_N, D] each). Start from 64 keys at head dims up to 64, 32 up to 128, 16 beyond, on 4 warps
    when every tile is at most 64 wide and q is half precision, else 8; then take the first of 8 warps
    and halved key tiles whose float32 tiles (K, V, q, acc, scores) come to at most REGISTER_FLOATS_HALF
    (or _FP32) per thread, or the smallest. The budgets are where sm_90 builds start to spill (compile
    gate, kernels/aot.py): float32 q uses FMA dots, which hold far more per thread. 16 warps spill more,
    not less (ptxas caps them at 64 registers), so they are never chosen.
    """
    widest = max(16, triton.next_power_of_2(max(info.D, info.Dv)))
    block_g = _block_g(info.G)
    budget = REGISTER_FLOATS_FP32 if q.element_size() == 4 else REGISTER_FLOATS_HALF
    first_n = max(16, min(64, 4096 // widest))
    first_w = 4 if widest <= 64 and q.element_size() < 4 else 8
    sizes = [first_n >> i for i in range(first_n.bit_length()) if first_n >> i >= 16]
    candidates = [(first_n, first_w), *((n, 8) for n in sizes)]

    def floats_per_thread(n, warps):
        return (2 * n * widest + 2 * block_g * widest + block_g * n) / (warps * 32)

    block_n, num_warps = next(
        ((n, w) for n, w in candidates if floats_per_thread(n, w) <= budget), candidates[-1]
    )
    plan = _plan_splits(q, info.Hkv, info.Dv, n_keys, num_splits, block_n=block_n)
    return plan._replace(num_warps=num_warps)


def _launch_quant_split(
    q, packed, fmt, info, mask, partials, plan, scale, start, length, block_table, keys_per_token, scores=None
):
    """Kernel 1 over the quantized segment: splits 0 .. plan.num_splits - 1 of ``partials``; ``scores``: None,
    or float32 [B, Hq, length] (any strides) that receives the log2-domain logits (-inf where masked)."""
    B, Hq, D = q.shape
    mid_o, mid_m, mid_l = partials
    per = fmt.per_byte
    pk, pv = D // per, info.Dv // per
    (mask_arg, smb, smn), (bt_arg, sbb, sbc), (scores_arg, ssb, ssh, ssn) = optional_args(
        q, mask, block_table if info.paged else None, scores, mid_m
    )  # fmt: skip
    # fp8 has no zero points: pass the scales in their place (never read, IS_FP8=True).
    k_zero = packed.k_scale if packed.k_zero is None else packed.k_zero
    v_zero = packed.v_scale if packed.v_zero is None else packed.v_zero
    # fmt: off
    _quant_split_kernel[(B, info.Hkv * plan.g_chunks, plan.num_splits)](
        q, packed.k, packed.k_scale, k_zero, packed.v, packed.v_scale, v_zero,
        mask_arg, mid_o, mid_m, mid_l, bt_arg, scores_arg,
        length, info.G, D, info.Dv, Hq, mid_m.shape[-1], plan.tiles_per_split, start, info.num_blocks,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        *packed.k.stride(), *packed.k_scale.stride(), *k_zero.stride(),
        *packed.v.stride(), *packed.v_scale.stride(), *v_zero.stride(),
        smb, smn,
        sbb, sbc,
        ssb, ssh, ssn,
        HAS_MASK=mask is not None,
        PAGED=info.paged, BLOCK_SIZE=info.T if info.paged else 1, GROUP=fmt.group_size,
        KEYS_PER_TOKEN=keys_per_token, STORE_SCORES=scores is not None,
        BITS=fmt.code_bits, PER=per, IS_FP8=fmt.is_float,
        PK=pk, PV=pv, PK_PAD=triton.next_power_of_2(pk), PV_PAD=triton.next_power_of_2(pv),
        G_CHUNKS=plan.g_chunks, BLOCK_G=plan.block_g, D_PAD=plan.d_pad, DV_PAD=plan.dv_pad,
        BLOCK_N=plan.block_n,
        # Dequantized K/V are float32: "tf32" rounds them (and P) to 11 significant bits on tensor
        # cores, below half-precision outputs' resolution; float32 q keeps float32 accuracy with "ieee".
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        enable_fp_fusion=True,
    )
    # fmt: on


def optional_args(q, mask, block_table, scores, mid_m):
    """Kernel 1's (tensor, strides) of its optional inputs, with a stand-in (never read or written: HAS_MASK,
    PAGED, STORE_SCORES false) where one is None: (mask, sb, sn), (block table, sb, sc), (scores, sb, sh, sn)."""
    # Masks as uint8: the same bytes; triton loads bytes more reliably than int1.
    mask_args = (q, 0, 0) if mask is None else (mask.view(torch.uint8), *mask.stride())
    table_args = (q, 0, 0) if block_table is None else (block_table, *block_table.stride())
    score_args = (mid_m, 0, 0, 0) if scores is None else (scores, *scores.stride())
    return mask_args, table_args, score_args


if triton is not None:

    @triton.jit
    def _dequant_tile(
        codes, scale, zero,
        BITS: tl.constexpr, PER: tl.constexpr, IS_FP8: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDTH: tl.constexpr,
    ):  # fmt: skip
        # codes uint8 [BLOCK_N, WIDTH // PER]; scale, zero float32 [BLOCK_N, WIDTH] in the unpacked
        # channel order: column i * (WIDTH // PER) + j holds the code in bits i*BITS.. of byte j.
        if IS_FP8:
            x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        else:
            if PER == 1:
                u = codes.to(tl.float32)
            else:
                shifts = tl.arange(0, PER) * BITS
                parts = (codes.to(tl.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
                u = tl.reshape(parts, [BLOCK_N, WIDTH]).to(tl.float32)  # [N, PER, WIDTH/PER] row-major
            x = zero + u * scale
        return x

    @triton.jit
    def _quant_split_kernel(
        Q, KC, KS, KZ, VC, VS, VZ, Mask, MidO, MidM, MidL, BT, Scores,
        N, G, D, DV, HQ, NUM_SPLITS, TILES_PER_SPLIT, START, NUM_BLOCKS,
        qk_scale,
        stride_qb, stride_qh,
        stride_kcb, stride_kch, stride_kcn, stride_kcp,
        stride_ksb, stride_ksh, stride_ksr, stride_ksd,
        stride_kzb, stride_kzh, stride_kzr, stride_kzd,
        stride_vcb, stride_vch, stride_vcn, stride_vcp,
        stride_vsb, stride_vsh, stride_vsn, stride_vsg,
        stride_vzb, stride_vzh, stride_vzn, stride_vzg,
        stride_mb, stride_mn,
        stride_btb, stride_btc,
        stride_sb, stride_sh, stride_sn,
        HAS_MASK: tl.constexpr,
        PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, KEYS_PER_TOKEN: tl.constexpr,
        STORE_SCORES: tl.constexpr,
        BITS: tl.constexpr, PER: tl.constexpr, IS_FP8: tl.constexpr,
        PK: tl.constexpr, PV: tl.constexpr, PK_PAD: tl.constexpr, PV_PAD: tl.constexpr,
        G_CHUNKS: tl.constexpr,
        BLOCK_G: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Key n (0 .. N-1) of row b is token t = START + n: dense, token t of the buffers of (b, head);
        # paged, block BT[b, t // BLOCK_SIZE] at offset o = t % BLOCK_SIZE (block ids outside
        # 0..NUM_BLOCKS-1 count as masked keys, never dereferenced). Its key scale/zero row is
        # t // GROUP (paged: o // GROUP of its block), its value scale/zero column c // GROUP. With
        # KEYS_PER_TOKEN the keys are laid out as the values: key scale/zero row t (o), column c // GROUP.
        #
        # Channel order. Unpacking a code tile [BLOCK_N, PK_PAD] with PER shifts gives register column
        # c' = i * PK_PAD + j for the code of channel i * PK + j (PK = D // PER bytes per token, PK_PAD
        # its next power of two, so D_PAD = PER * PK_PAD). Everything on the key side (q, scales, zeros)
        # is loaded in that order, which leaves q.k unchanged; the value side likewise with PV, and the
        # accumulator is stored back to channel order.
        #
        # STORE_SCORES (compile time): also write the log2-domain logits of every key n < N into Scores
        # [B, HQ, N] float32 (-inf where masked), for the attention mass (as decode_attention's split
        # kernel); Scores is never touched otherwise.
        pid_b = tl.program_id(0).to(tl.int64)
        pid_hg = tl.program_id(1)
        pid_s = tl.program_id(2)
        pid_h = (pid_hg // G_CHUNKS).to(tl.int64)  # KV head
        chunk = pid_hg % G_CHUNKS  # which BLOCK_G rows of its query group

        offs_g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
        g_ok = offs_g < G
        offs_c = tl.arange(0, D_PAD)
        kj = offs_c % PK_PAD
        k_ch = (offs_c // PK_PAD) * PK + kj  # channel of register column c'
        k_ok = kj < PK
        k_col = k_ch // GROUP if KEYS_PER_TOKEN else k_ch  # its column of the key scales and zeros
        offs_cv = tl.arange(0, DV_PAD)
        vj = offs_cv % PV_PAD
        v_ch = (offs_cv // PV_PAD) * PV + vj
        v_ok = vj < PV
        v_grp = v_ch // GROUP
        offs_pk = tl.arange(0, PK_PAD)
        offs_pv = tl.arange(0, PV_PAD)

        q_rows = pid_h * G + offs_g
        q_ptrs = Q + pid_b * stride_qb + q_rows[:, None] * stride_qh + k_ch[None, :]
        q = tl.load(q_ptrs, mask=g_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)

        if PAGED:
            kc_base = KC + pid_h * stride_kch
            ks_base = KS + pid_h * stride_ksh
            kz_base = KZ + pid_h * stride_kzh
            vc_base = VC + pid_h * stride_vch
            vs_base = VS + pid_h * stride_vsh
            vz_base = VZ + pid_h * stride_vzh
            bt_row = BT + pid_b * stride_btb
        else:
            kc_base = KC + pid_b * stride_kcb + pid_h * stride_kch
            ks_base = KS + pid_b * stride_ksb + pid_h * stride_ksh
            kz_base = KZ + pid_b * stride_kzb + pid_h * stride_kzh
            vc_base = VC + pid_b * stride_vcb + pid_h * stride_vch
            vs_base = VS + pid_b * stride_vsb + pid_h * stride_vsh
            vz_base = VZ + pid_b * stride_vzb + pid_h * stride_vzh

        # Finite initial max: a row that sees only masked keys keeps m = -1e30, p = 0, l = 0 (no NaN).
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, DV_PAD], dtype=tl.float32)

        start = pid_s * TILES_PER_SPLIT * BLOCK_N
        end = tl.minimum(start + TILES_PER_SPLIT * BLOCK_N, N)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_in = offs_n < N
            n_ok = n_in
            offs_n64 = offs_n.to(tl.int64)
            if HAS_MASK:
                keep = tl.load(Mask + pid_b * stride_mb + offs_n64 * stride_mn, mask=n_ok, other=0)
                n_ok = n_ok & (keep != 0)  # masked keys are not even loaded
            tok = START + offs_n64
            if PAGED:
                blk = tl.load(bt_row + (tok // BLOCK_SIZE) * stride_btc, mask=n_ok, other=0).to(tl.int64)
                n_ok = n_ok & (blk >= 0) & (blk < NUM_BLOCKS)
                off = tok % BLOCK_SIZE
                kc_rows = blk * stride_kcb + off * stride_kcn
                k_row = off if KEYS_PER_TOKEN else off // GROUP
                ks_rows = blk * stride_ksb + k_row * stride_ksr
                kz_rows = blk * stride_kzb + k_row * stride_kzr
                vc_rows = blk * stride_vcb + off * stride_vcn
                vs_rows = blk * stride_vsb + off * stride_vsn
                vz_rows = blk * stride_vzb + off * stride_vzn
            else:
                kc_rows = tok * stride_kcn
                k_row = tok if KEYS_PER_TOKEN else tok // GROUP
                ks_rows = k_row * stride_ksr
                kz_rows = k_row * stride_kzr
                vc_rows = tok * stride_vcn
                vs_rows = tok * stride_vsn
                vz_rows = tok * stride_vzn

            # Keys: codes [BLOCK_N, PK_PAD], scale/zero gathered per token and channel [BLOCK_N, D_PAD].
            nk = n_ok[:, None] & k_ok[None, :]
            kc = tl.load(
                kc_base + kc_rows[:, None] + offs_pk[None, :] * stride_kcp,
                mask=n_ok[:, None] & (offs_pk < PK)[None, :], other=0,
            )  # fmt: skip
            ks = tl.load(ks_base + ks_rows[:, None] + k_col[None, :] * stride_ksd, mask=nk, other=0.0)
            ks = ks.to(tl.float32)
            if IS_FP8:
                kz = ks  # unused
            else:
                kz = tl.load(kz_base + kz_rows[:, None] + k_col[None, :] * stride_kzd, mask=nk, other=0.0)
                kz = kz.to(tl.float32)
            k = _dequant_tile(kc, ks, kz, BITS, PER, IS_FP8, BLOCK_N, D_PAD)

            # Values: codes [BLOCK_N, PV_PAD], scale/zero of column c // GROUP per token [BLOCK_N, DV_PAD].
            nv = n_ok[:, None] & v_ok[None, :]
            vc = tl.load(
                vc_base + vc_rows[:, None] + offs_pv[None, :] * stride_vcp,
                mask=n_ok[:, None] & (offs_pv < PV)[None, :], other=0,
            )  # fmt: skip
            vs = tl.load(vs_base + vs_rows[:, None] + v_grp[None, :] * stride_vsg, mask=nv, other=0.0)
            vs = vs.to(tl.float32)
            if IS_FP8:
                vz = vs  # unused
            else:
                vz = tl.load(vz_base + vz_rows[:, None] + v_grp[None, :] * stride_vzg, mask=nv, other=0.0)
                vz = vz.to(tl.float32)
            v = _dequant_tile(vc, vs, vz, BITS, PER, IS_FP8, BLOCK_N, DV_PAD)

            # Scores in the log2 domain; masked keys are -inf, so exp2(-inf - finite max) = 0.
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            if STORE_SCORES:
                s_ptrs = Scores + pid_b * stride_sb + q_rows[:, None] * stride_sh + offs_n64[None, :] * stride_sn
                tl.store(s_ptrs, s, mask=g_ok[:, None] & n_in[None, :])
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Partials of query head (pid_h * G + g), split slot pid_s (the quantized splits come first).
        row = (pid_b * HQ + q_rows) * NUM_SPLITS + pid_s
        tl.store(MidM + row, m_i, mask=g_ok)
        tl.store(MidL + row, l_i, mask=g_ok)
        tl.store(MidO + row[:, None] * DV + v_ch[None, :], acc, mask=g_ok[:, None] & v_ok[None, :])


# ---------------------------------------------------------------------------------------------------
# Torch twin
# ---------------------------------------------------------------------------------------------------


def gather_blocks(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``ids`` (int64 [B, c]) of pool [num_blocks, Hkv, rows, dim] as [B, Hkv, c * rows, dim].

    Gathered column by column ([c, B, ...], then permuted): split as [B, c], dynamo's reshape of a symbolic block
    count took half the trace time of a paged quantized decode step (sympy), for the same values."""
    _, hkv, rows, dim = pool.shape
    B, c = ids.shape
    picked = pool.index_select(0, ids.t().reshape(-1)).view(c, B, hkv, rows, dim)
    return picked.permute(1, 2, 0, 3, 4).reshape(B, hkv, c * rows, dim)


def _quant_chunks(packed, fmt, info, start, length, block_table, keys_per_token):
    """Yield (first token t0, end token t1, the packed tensors of tokens t0 .. t1 - 1) chunk by chunk."""
    G = 1 if keys_per_token else fmt.group_size  # tokens per key-scale row
    end = start + length
    if info.paged:
        bs = info.T
        first_col, end_col = start // bs, (end - 1) // bs + 1
        cols = block_table[:, first_col:end_col].long()
        step = max(1, TWIN_CHUNK_TOKENS // bs)
        for c in range(first_col, end_col, step):
            c_end = min(c + step, end_col)
            ids = cols[:, c - first_col : c_end - first_col]
            tensors = (packed.k, packed.k_scale, packed.k_zero, packed.v, packed.v_scale, packed.v_zero)
            parts = [None if t is None else gather_blocks(t, ids) for t in tensors]
            t0, t1 = c * bs, c_end * bs
            yield t0, t1, parts
    else:
        step = max(1, TWIN_CHUNK_TOKENS // G)
        for g0 in range(start // G, -(-end // G), step):  # g0, g1: key-scale rows
            g1 = min(g0 + step, -(-end // G))
            t0, t1 = g0 * G, g1 * G
            if t0 == 0 and t1 == info.T:  # the buffers are the chunk (a storage's read cut them to it)
                yield t0, t1, [packed.k, packed.k_scale, packed.k_zero, packed.v, packed.v_scale, packed.v_zero]
                continue
            parts = [
                packed.k[:, :, t0:t1],
                packed.k_scale[:, :, g0:g1],
                None if packed.k_zero is None else packed.k_zero[:, :, g0:g1],
                packed.v[:, :, t0:t1],
                packed.v_scale[:, :, t0:t1],
                None if packed.v_zero is None else packed.v_zero[:, :, t0:t1],
            ]
            yield t0, t1, parts


def quantized_decode_attention_torch(
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
    check: bool = True,
    state=None,
) -> torch.Tensor:
    """Plain-torch twin: dequantizes a chunk at a time, online softmax in float32 across the chunks
    (keys that fit one chunk, residual included, go through one float32 SDPA).

    ``num_splits`` is validated (with ``check``) and otherwise ignored (it only shapes the Triton launch).

    Each chunk (about TWIN_CHUNK_TOKENS keys of all rows and KV heads) is dequantized with
    ``quant_format.dequantize_keys/values`` (paged: its blocks gathered first), then q k^T and p v run
    as batched matmuls over (row, KV head) with the query group as the rows. Paged: also checks that
    the table columns it reads hold block ids of the pool (ShapeError otherwise; a host read of the
    table, skipped with ``check=False``).
    """
    args = (q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits)
    return _twin(*args, keys_per_token, check, with_mass=False, state=state)[0]


def quantized_decode_attention_with_mass_torch(
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
    check: bool = True,
    state=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of ``quantized_decode_attention_with_mass`` (``kernels/dispatch.py``): the chunks of
    :func:`quantized_decode_attention_torch`, each chunk's logits kept (float32 [B, Hq, length + R], what the
    Triton path stores too) and turned into probabilities once the log-sum-exp is known; keys that fit one
    chunk go through ``decode_attention_with_mass_torch``."""
    args = (q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits)
    return _twin(*args, keys_per_token, check, with_mass=True, state=state)


def _twin(
    q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits, keys_per_token,
    check, *, with_mass, planes=False, ring_in_channels=False, state=None,
):  # fmt: skip
    """Both twins: (output, mass or None); `planes`: traced off CUDA, the codes' planes kept (a rotated format's
    channels in plane order, see `dispatch._rotated`); `ring_in_channels`: with `planes`, the residual in channel
    order, folded in last, and the output in channel order; `state`: the layer's (a key centre), read with the keys."""
    if check:
        info = _check_inputs(
            q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits,
            keys_per_token,
        )
        if info.paged and length > 0:
            bs = info.T
            first_col, end_col = start // bs, (start + length - 1) // bs + 1
            _check_block_ids(
                block_table[:, first_col:end_col], info.num_blocks, first_col, end_col, start, length
            )
    else:
        info = _dims(q, packed, fmt, residual_k, block_table)
    B, Hq, Hkv, G, D, Dv, R = info.B, info.Hq, info.Hkv, info.G, info.D, info.Dv, info.R

    chunks = _quant_chunks(packed, fmt, info, start, length, block_table, keys_per_token) if length > 0 else iter(())
    read = (fmt, state)
    head = list(itertools.islice(chunks, 2))
    if length + R <= TWIN_CHUNK_TOKENS and len(head) < 2 and not ring_in_channels:
        k, v = _one_chunk(read, info, head[0] if head else None, start, length, residual_k, residual_v, keys_per_token,
                          planes)  # fmt: skip
        if with_mass:
            return decode_attention_with_mass_torch(q, k, v, scale=scale, mask=mask, check=False)
        return grouped_sdpa(q.float(), k, v, mask, scale).to(q.dtype), None

    # Scores in the log2 domain, as in the kernel.
    qg = q.reshape(B, Hkv, G, D).to(torch.float32) * (float(scale) * LOG2E)
    bias = None
    if mask is not None:
        # Additive mask: 0 where attended, -inf where masked (exp2(-inf - finite max) = 0).
        bias = torch.zeros(B, length + R, dtype=torch.float32, device=q.device).masked_fill_(
            ~mask, float("-inf")
        )
    running = [None, None, None]  # running max, sum, accumulator
    logits = [] if with_mass else None

    last = None  # the last chunk (index of its first key, K, V): the residual joins it when both fit one chunk
    for chunk in itertools.chain(head, chunks):
        if last is not None:
            n0, k, v = last
            _online_step(running, qg, k, v, None if bias is None else bias[:, n0 : n0 + k.shape[2]], logits)
        last = _dequantized_chunk(chunk, read, start, length, keys_per_token, planes)
    joined = 0  # residual keys that went with the last chunk
    if last is not None:  # it ends at key `length`, where the residual starts
        n0, k, v = last
        # one step, not two (a tail chunk and the window, mostly); a ring in channel order goes on its own
        if 0 < R <= TWIN_CHUNK_TOKENS - k.shape[2] and not ring_in_channels:
            k = _cat_tokens(_plane_count(fmt, "keys", planes, D), [k, residual_k.float()])
            v = _cat_tokens(_plane_count(fmt, "values", planes, Dv), [v, residual_v.float()])
            joined = R
        _online_step(running, qg, k, v, None if bias is None else bias[:, n0 : n0 + k.shape[2]], logits)
    if ring_in_channels:  # from here on in channel order: q, the output so far, and the ring
        qg = from_plane_order(qg, fmt.key_bits)
        running[2] = None if running[2] is None else from_plane_order(running[2], fmt.value_bits)
    for r0 in range(joined, R, TWIN_CHUNK_TOKENS):
        r1 = min(r0 + TWIN_CHUNK_TOKENS, R)
        k, v = residual_k[:, :, r0:r1].float(), residual_v[:, :, r0:r1].float()
        _online_step(running, qg, k, v, None if bias is None else bias[:, length + r0 : length + r1], logits)

    m_run, l_run, acc = running
    # Every key masked: acc and l are both 0; output zeros instead of 0/0.
    live = l_run > 0
    out = acc.div_(torch.where(live, l_run, 1.0)[..., None]).reshape(B, Hq, Dv).to(q.dtype)
    if not with_mass:
        return out, None
    # Every key masked: lse +inf, so each (-inf) logit's probability is 0, never NaN.
    lse = torch.where(live, m_run + torch.log2(torch.where(live, l_run, 1.0)), float("inf"))
    return out, torch.exp2(torch.cat(logits, dim=-1).sub_(lse[..., None])).sum(dim=2)


def _dequantized_chunk(chunk, read, start, length, keys_per_token, planes=False):
    """(index of its first attended key, K, V float32) of a chunk of :func:`_quant_chunks`, cut to the attended keys
    (a rotated format's left in the rotated space: its per-token keys are coded with the key bits); `read`: (the
    format, the layer's state)."""
    fmt, state = read
    t0, t1, (kc, ks, kz, vc, vs, vz) = chunk
    lo, hi = max(start, t0) - t0, min(start + length, t1) - t0
    positions = fmt.key_positions(t0, t1 - t0, kc.device, state)
    k = fmt.attended(kc, ks, kz, "keys", per_token=keys_per_token, planes=planes, positions=positions,
                     **state_kw(state))  # fmt: skip
    if lo or hi != t1 - t0:  # part of the chunk (a whole chunk, the decode steady state, is not sliced)
        k, vc, vs, vz = k[:, :, lo:hi], vc[:, :, lo:hi], vs[:, :, lo:hi], None if vz is None else vz[:, :, lo:hi]
    return t0 + lo - start, k, fmt.attended(vc, vs, vz, "values", planes=planes)


def _one_chunk(read, info, chunk, start, length, residual_k, residual_v, keys_per_token, planes=False):
    """All keys in one chunk: K, V float32, dequantized with the residual appended, for one float32 SDPA (a
    short context's host cost is its op count, about half the online-softmax path's)."""
    ks, vs = [], []
    if chunk is not None:
        _, k, v = _dequantized_chunk(chunk, read, start, length, keys_per_token, planes)
        ks.append(k)
        vs.append(v)
    if info.R:
        ks.append(residual_k.float())
        vs.append(residual_v.float())
    if len(ks) == 1:
        return ks[0], vs[0]
    keys = _cat_tokens(_plane_count(read[0], "keys", planes, info.D), ks)
    return keys, _cat_tokens(_plane_count(read[0], "values", planes, info.Dv), vs)


def _plane_count(fmt, side: str, planes: bool, head_dim: int) -> int:
    """The planes a side's dequantized channels come in, with `planes` (a twin traced off CUDA: the format's
    `KVFormat.planes`); else 1, none to keep (eager, the planes' views would only add host work)."""
    return fmt.planes(side, head_dim) if planes else 1


def _cat_tokens(per: int, parts: list[torch.Tensor]) -> torch.Tensor:
    """Dequantized tokens and exact ones `[B, Hkv, n, D]` joined along the tokens, through the code planes'
    shape `[..., per, D / per]` (the same memory): compiled, the join then loops over the planes, whose shift (or
    table column) is the same for a whole row of bytes, and not over channels in order (`channel // P` shifts,
    `channel % P` bytes: inductor runs that element by element)."""
    if per == 1:
        return torch.cat(parts, dim=2)
    return torch.cat([t.unflatten(-1, (per, -1)) for t in parts], dim=2).flatten(-2)


def _online_step(state, qg, k, v, bias, logits=None) -> None:
    """Fold keys k [B, Hkv, n, D] / values v [B, Hkv, n, Dv] (float32) into state [m, l, acc] in place;
    ``logits``: None, or a list that receives a copy of the chunk's (masked) logits."""
    s = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, G, n], scaled, log2 domain
    if bias is not None:
        s.add_(bias[:, None, None, :])
    if logits is not None:
        logits.append(s.clone())
    m_run, l_run, acc = state
    m_chunk = s.amax(dim=-1)
    if m_run is None:
        # Finite floor: a row that has seen only masked keys keeps m = -1e30, p = 0, l = 0 (no NaN).
        m_new = m_chunk.clamp_(min=-1.0e30)
    else:
        m_new = torch.maximum(m_run, m_chunk)
    p = s.sub_(m_new[..., None]).exp2_()
    pv = torch.matmul(p, v)
    if m_run is None:
        l_run, acc = p.sum(dim=-1), pv
    else:
        alpha = torch.exp2(m_run - m_new)
        l_run = l_run.mul_(alpha).add_(p.sum(dim=-1))
        acc = acc.mul_(alpha[..., None]).add_(pv)
    state[:] = [m_new, l_run, acc]
