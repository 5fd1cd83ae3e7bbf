"""Quantize-and-pack for a rotated format (``kernels/rotated_format.py``): ``quantize_rotated`` in Triton.

:func:`quantize_rotated_triton` rotates in torch (``x.float() @ R``, one matmul, and ``|x|``: the twin's own
ops, so both see the same float32 numbers), then ``_rotated_pack_kernel`` does the rest per token: unit =
x_rot / |x| (``div_rn``: Triton's ``/`` is approximate on NVIDIA), code = the number of decision boundaries
below it (a branchless binary search over the codebook's 2**bits - 1 boundaries: the comparisons of
``torch.bucketize``, so the codes equal the twin's bit for bit, ties included), norm = |x| / |centroid[codes]|
rounded to float16, and the bit stream (each run of 8 codes one int64 word of 8 * bits bits, stored as bits
little-endian bytes). The norms' float32 sum of squares runs in another order than torch's, so a norm may
differ from the twin's by one float16 ulp (rarely: none of 18,000 tokens on the CPU); the codes never do. The
kernel always re-normalizes (``rotated_format.RENORMALIZE``, which is True). A side with a centre: torch picks what
each token codes (``rotated_format.centered``: ``x - mu`` or ``x``, whichever is shorter) and passes the plain
ones' lengths negative (``-max(|x|, 1e-30)``); the kernel codes ``|length|`` and stores the plain tokens' norms as
``-max(norm, 2**-24)`` (``rotated_format.signed_norms``).

x [B, H, T, D] float32, float16 or bfloat16, any strides, D a multiple of 8; ``side`` "keys" or "values" picks
the bit width. Results: codes uint8 [B, H, T, D * bits // 8], norms float16 [B, H, T, 1], and None (a rotated
format has no zero points). ``out`` = (codes, norms, None) of those shapes (any strides) is written instead of
fresh tensors; with ``slots`` (int64 [B, H, T]) token t of (b, h) goes to row ``slots[b, h, t]`` of ``out``'s
tensors ([B, H, N, ...]), every other row untouched (an evicting cache's refill; slots distinct per (b, h) and
in 0..N-1, not checked: reading them would sync). ``check=False`` skips validation (sizes come off x's shape).
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels.decode_attention import _is_interpreted
from hf_kvplus.kernels.errors import ConfigError, DeviceError, DTypeError, KernelUnavailableError, ShapeError
from hf_kvplus.kernels.rotated_format import (
    PLAIN_NORM,
    RotatedFormat,
    centered,
    codebook,
    rotation,
    scaled_keys,
)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

__all__ = ["quantize_rotated_triton"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Coordinates per program (BLOCK_T tokens x the padded head dim): 16 tokens at head dim 128.
TILE_ELEMENTS = 2048
NUM_WARPS = 4


def quantize_rotated_triton(
    x, fmt: RotatedFormat, side: str, out=None, slots=None, *, check: bool = True, positions=None, center=None
):  # fmt: skip
    """x [B, H, T, D] -> (codes, norms, None) as ``quantize_rotated``, written into ``out`` (rows ``slots``)
    when given (see the module doc; `center`: the layer's key centre, given with the keys; `positions`: the tokens'
    indices, for a turning key centre)."""
    if check:
        _check(x, fmt, side, out, slots)
    B, H, T, D = x.shape
    bits = fmt.bits_of(side)
    if out is None:
        out = (
            torch.empty((B, H, T, D * bits // 8), dtype=torch.uint8, device=x.device),
            torch.empty((B, H, T, 1), dtype=torch.float16, device=x.device),
            None,
        )
    codes, norms, _ = out
    if B * H * T == 0:
        return out
    xf, length, sign = centered(scaled_keys(x, fmt, center), fmt, positions, center)
    x_rot = xf if fmt.inputs_rotated else xf @ rotation(D, fmt.seed, x.device)
    length = length[..., 0]  # [B, H, T]
    if sign is not None:  # plain codes: negative lengths
        length = torch.where(sign[..., 0] < 0, -length.clamp_min(1e-30), length)
    centroids, boundaries = codebook(D, bits, x.device)
    runs = D // 8
    runs_pad = triton.next_power_of_2(runs)
    block_t = min(triton.next_power_of_2(T), max(1, TILE_ELEMENTS // (8 * runs_pad)))
    _rotated_pack_kernel[(B * H, triton.cdiv(T, block_t))](
        x_rot, length, centroids, boundaries, codes, norms,
        codes if slots is None else slots,  # never read without slots (HAS_SLOTS=False)
        H, T,
        *x_rot.stride(), *length.stride(),
        *codes.stride(), *norms.stride()[:3],
        *((0, 0, 0) if slots is None else slots.stride()),
        HAS_SLOTS=slots is not None, SIGNED=sign is not None, PLAIN=PLAIN_NORM,
        RUNS=runs, RUNS_PAD=runs_pad, BITS=bits, BYTES_PAD=triton.next_power_of_2(bits), BLOCK_T=block_t,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # every product rounded, as torch does
    )  # fmt: skip
    return out


def _check(x, fmt, side, out, slots) -> None:
    """The contract of the module doc: types, dtypes, shapes, devices (slot values are not read)."""
    if triton is None:
        raise KernelUnavailableError("quantize_rotated_triton needs triton, which is not installed")
    if not isinstance(fmt, RotatedFormat):
        raise ConfigError(f"fmt must be a RotatedFormat, got {type(fmt).__name__}")
    if side not in ("keys", "values"):
        raise ConfigError(f"side must be 'keys' or 'values', got {side!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in SUPPORTED_DTYPES:
        got = getattr(x, "dtype", type(x).__name__)
        raise DTypeError(f"x must be a tensor of {SUPPORTED_DTYPES}, got {got}")
    if x.dim() != 4:
        raise ShapeError(f"x must have 4 dims ([B, H, T, D]), got shape {tuple(x.shape)}")
    B, H, T, D = x.shape
    fmt.check_head_dim(D)
    if not x.is_cuda and not _is_interpreted(_rotated_pack_kernel):
        raise KernelUnavailableError(
            f"quantize_rotated_triton needs CUDA tensors (got {x.device}) or TRITON_INTERPRET=1 set before "
            "import"
        )
    if slots is not None:
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or tuple(slots.shape) != (B, H, T):
            raise ShapeError(
                f"slots must be an int64 tensor [B, H, T] = {[B, H, T]}, got "
                f"{getattr(slots, 'dtype', type(slots).__name__)} {list(getattr(slots, 'shape', []))}"
            )
        if slots.device != x.device:
            raise DeviceError(f"slots are on {slots.device}, x on {x.device}")
        if out is None:
            raise ConfigError("slots need out: the tensors whose rows they name")
    if out is None:
        return
    if not isinstance(out, (tuple, list)) or len(out) != 3 or out[2] is not None:
        raise ShapeError("out must be a tuple (codes, norms, None): a rotated format has no zero points")
    codes = out[0]
    rows = codes.shape[2] if slots is not None and isinstance(codes, torch.Tensor) and codes.dim() == 4 else T
    want = (
        ("codes", torch.uint8, (B, H, rows, fmt.code_dim(D, side))),
        ("norms", torch.float16, (B, H, rows, 1)),
    )
    for t, (name, dtype, shape) in zip(out, want, strict=False):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = getattr(t, "dtype", type(t).__name__)
            raise DTypeError(f"out {name} must be a {dtype} tensor, got {got}")
        if tuple(t.shape) != shape:
            raise ShapeError(
                f"out {name} of {side} {list(x.shape)} ({fmt}) must be {list(shape)}, got {list(t.shape)}"
            )
        if t.device != x.device:
            raise DeviceError(f"out {name} is on {t.device}, x on {x.device}")


if triton is not None:

    @triton.jit
    def _rotated_pack_kernel(
        XR, Len, Book, Bounds, C, Nrm, Slots,
        H, T,
        stride_xb, stride_xh, stride_xt, stride_xd,
        stride_lb, stride_lh, stride_lt,
        stride_cb, stride_ch, stride_ct, stride_cp,
        stride_nb, stride_nh, stride_nt,
        stride_ib, stride_ih, stride_it,
        HAS_SLOTS: tl.constexpr, SIGNED: tl.constexpr, PLAIN: tl.constexpr,
        RUNS: tl.constexpr, RUNS_PAD: tl.constexpr, BITS: tl.constexpr, BYTES_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        # Program (row * H + head, token block). Tile [BLOCK_T, RUNS_PAD, 8]: element [t, r, i] is coordinate
        # r * 8 + i of token t0 + t (XR [B, H, T, D], Len [B, H, T]: x @ R and |x|, negative for a plain code
        # when SIGNED). HAS_SLOTS (compile time): token t of (b, h) is written to row Slots[b, h, t] of C and Nrm
        # instead of row t.
        pid_bh = tl.program_id(0).to(tl.int64)
        pid_t = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_r = tl.arange(0, RUNS_PAD)
        offs_i = tl.arange(0, 8)
        t_ok = offs_t < T
        r_ok = offs_r < RUNS
        ok = t_ok[:, None, None] & r_ok[None, :, None]
        tok = offs_t.to(tl.int64)
        coord = offs_r[:, None] * 8 + offs_i[None, :]  # [RUNS_PAD, 8]
        x_row = XR + b * stride_xb + h * stride_xh + tok * stride_xt
        xr = tl.load(x_row[:, None, None] + (coord * stride_xd)[None, :, :], mask=ok, other=0.0)
        signed = tl.load(Len + b * stride_lb + h * stride_lh + tok * stride_lt, mask=t_ok, other=0.0)
        length = tl.abs(signed)
        unit = tl.math.div_rn(xr, tl.maximum(length, 1e-30)[:, None, None] + tl.zeros_like(xr))

        # code = #{boundaries < unit}: binary search over the 2**BITS - 1 sorted boundaries.
        code = tl.zeros([BLOCK_T, RUNS_PAD, 8], dtype=tl.int32)
        for level in tl.static_range(BITS):
            step = 1 << (BITS - 1 - level)
            code = tl.where(tl.load(Bounds + code + (step - 1)) < unit, code + step, code)

        centroid = tl.where(ok, tl.load(Book + code), 0.0)
        decoded = tl.sqrt_rn(tl.sum(tl.sum(centroid * centroid, axis=2), axis=1))
        norm = tl.math.div_rn(length, tl.maximum(decoded, 1e-30)).to(tl.float16)
        if SIGNED:  # a plain code's norm: -max(norm, PLAIN), so that even a zero vector's reads as plain
            norm = tl.where(signed < 0, -tl.maximum(norm, tl.full([BLOCK_T], PLAIN, tl.float16)), norm)

        # Each run of 8 codes: one word of 8 * BITS bits (disjoint, so the sum is an or), BITS bytes of it.
        shifts = (offs_i * BITS).to(tl.int64)
        word = tl.sum(code.to(tl.int64) << shifts[None, None, :], axis=2)  # [BLOCK_T, RUNS_PAD]
        offs_j = tl.arange(0, BYTES_PAD)
        byte = (word[:, :, None] >> (offs_j * 8).to(tl.int64)[None, None, :]) & 255

        row = tok
        if HAS_SLOTS:
            row = tl.load(Slots + b * stride_ib + h * stride_ih + tok * stride_it, mask=t_ok, other=0)
        c_ptrs = (
            C + b * stride_cb + h * stride_ch + row[:, None, None] * stride_ct
            + (offs_r[:, None] * BITS + offs_j[None, :])[None, :, :] * stride_cp
        )  # fmt: skip
        tl.store(c_ptrs, byte.to(tl.uint8), mask=ok & (offs_j < BITS)[None, None, :])
        tl.store(Nrm + b * stride_nb + h * stride_nh + row * stride_nt, norm, mask=t_ok)
