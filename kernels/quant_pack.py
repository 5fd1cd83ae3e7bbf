"""Quantize-and-pack: float K/V to the group-quantized byte layout of ``kernels/quant_format.py``.

Two operations share one contract, each with three entry points:

- ``quantize_keys`` / ``quantize_values`` (``kernels/dispatch.py``) dispatch: CUDA tensors go to the Triton
  kernels, everything else to :func:`quantize_off_cuda`, the plain-torch twins of ``quant_format`` (with ``out``
  given, the twin's results are copied into it).
- :func:`quantize_keys_triton` / :func:`quantize_values_triton` are the Triton kernels (CUDA tensors,
  or any tensors under ``TRITON_INTERPRET=1``), bit-identical to the twins of ``quant_format`` run on
  the CPU for the integer formats; fp8 codes are identical except that a code of zero may carry either
  sign (both decode to 0).

Shapes (Triton path): x [B, H, T, D] in float32, float16 or bfloat16, any strides. Keys are quantized
per channel in groups of ``fmt.group_size`` tokens (T must be a multiple of it), values per token in
groups of ``fmt.group_size`` channels; ``fmt.check_head_dim(D)`` must pass. Results (``per`` codes per
byte, ``P = D // per``):

- codes uint8 [B, H, T, P] (byte j of a token holds channel ``i * P + j`` in bits ``i * bits ..``),
- keys: scale, zero float16 [B, H, T // G, D]; values: scale, zero float16 [B, H, T, D // G],
- zero is None for fp8.

``out`` is None (fresh contiguous tensors are returned) or a tuple (codes, scale, zero) of 4-d tensors
of exactly those shapes and dtypes on x's device, with any strides: typically slices along the token
dim of larger storage buffers. Every element of the out tensors is written and nothing outside them;
they are returned.

``quantize_values_at`` (``kernels/dispatch.py``; twins :func:`quantize_values_at_torch` and
:func:`quantize_values_at_triton`) quantizes
values the same way into given rows of larger buffers (an int64 ``slots`` [B, H, T] names the row of each
token), the values kernel storing each token at its slot: a storage that refills single slots writes its
codes, scales and zeros in one launch.

Kernels. Keys: one program per (row and head, group of G tokens, chunk of bytes): the program loads
the group as a [G, per, BLOCK_P] tile (element [t, i, j] is channel ``i * P + j``, the packed order),
reduces min/max over tokens, encodes, and packs each byte by shifting part i by ``i * bits`` and
summing over the parts (they do not overlap). Values: one program per (row and head, BLOCK_T tokens)
holding all channels of its tokens in the same [BLOCK_T, per, P] layout; the per-(token, channel
group) min/max is a loop over the D // G groups with a channel mask (groups of any size, any D, no
gather). Both run the twin's float32 arithmetic op by op:

- zero = f16(lo - |lo| * 2**-10 - 2**-24), scale = f16(max((hi - zero) / qmax * (1 + 2**-10), 2**-24)),
  q = clamp(floor((x - zero) / scale + 0.5), 0, qmax); fp8: scale = f16(max(amax / 448 * (1 + 2**-10),
  2**-24)), q = e4m3(clamp(x / scale, -448, 448)).
- Divisions use ``tl.math.div_rn`` (IEEE round-to-nearest: ``div.rn.f32`` on NVIDIA, numpy's float32
  divide in the interpreter). Triton's ``/`` lowers to ``div.full.f32`` on NVIDIA, which is off by up
  to 2 ulp, and a one-ulp difference before ``floor`` or the float16 rounding changes codes.
- The launch passes ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA (the twin
  rounds each product).
- float32 -> float16 is ``.to(tl.float16)`` (round to nearest even, as torch).
- e4m3 is encoded with integer arithmetic on the float32 bits (the conversion of torch's c10
  ``fp8e4m3fn_from_fp32_value``): the interpreter's ``.to(tl.float8e4nv)`` is wrong (42.29 -> 44),
  and this way the GPU and the interpreter run the same code.

Inputs beyond float16's range (possible in bfloat16/float32) give infinite scales or zero points, as
in the twins; NaN inputs give unspecified codes.

``check`` (keyword, every entry point; the dispatchers pass it on): True (the default) validates the
contract above. False skips it (``fmt``, x's type, dtype and shape, ``out``'s tensors, whether Triton
can run): sizes come off x's shape only. For callers whose inputs are valid by construction (the
caches' storages); invalid input is then undefined behaviour. No path reads a tensor value on the host.
(The twins are ``quant_format``'s functions, which keep their own few shape checks.)
While ``torch.compile`` (or ``torch.export``) traces, a dispatcher called with ``check=False`` runs one
custom operator, ``torch.ops.kvplus.quantize_keys`` / ``quantize_values`` (``kernels/custom_ops.py``),
writing into ``out`` (or into tensors allocated first), with the same Triton kernel; off CUDA the twin is
traced inline instead, except for a rotated format's [B, H, T, D] CPU tensors, which eager and compiled calls alike
code with the C++ operator ``torch.ops.hf_kvplus_cpu.rotated_encode`` (``kernels/rotated_cpu.py``) where it is built.
Off CUDA the KIVI formats code with ``torch.ops.hf_kvplus_cpu.kivi_encode`` (``kernels/kivi_cpu.py``), bit for bit the twins.
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels.decode_attention import _is_interpreted
from hf_kvplus.kernels.errors import ConfigError, DeviceError, DTypeError, KernelUnavailableError, ShapeError
from hf_kvplus.kernels.kv_format import KVFormat, kernels_for
from hf_kvplus.kernels.quant_format import _HALF_TINY, _MARGIN, _TINY, FP8_MAX, QuantFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twins still work without triton
    triton = None
    tl = None

__all__ = [
    "quantize_keys_triton",
    "quantize_off_cuda",
    "quantize_values_at_torch",
    "quantize_values_at_triton",
    "quantize_values_triton",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements of the float32 tile of one program (keys: G x per x BLOCK_P, values: BLOCK_T x per x P_PAD).
# ptxas (sm_90, fp16 input, head_dim 128, 4 warps, no spills): keys at 4096 use about 80 registers;
# values, which also carry per-channel scale/zero tiles, use about 70 at 1024 (8 tokens) and 220 at 4096.
KEY_TILE_ELEMENTS = 4096
VALUE_TILE_ELEMENTS = 1024
NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def _check_fmt(fmt) -> None:
    if not isinstance(fmt, KVFormat):
        raise ConfigError(f"fmt must be a KVFormat (a QuantFormat, a RotatedFormat, ...), got {type(fmt).__name__}")


def _check_x(x, what: str) -> tuple[int, int, int, int]:
    """x must be a 4-d float tensor [B, H, T, D]; return its shape."""
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(f"{what} dtype {x.dtype} is not supported; expected one of {SUPPORTED_DTYPES}")
    if x.dim() != 4:
        raise ShapeError(
            f"{what} must have 4 dims ([B, H, T, D]), got {x.dim()} dims with shape {tuple(x.shape)}"
        )
    return tuple(x.shape)


def _expected_shapes(kind: str, shape, fmt: QuantFormat) -> tuple[tuple, tuple]:
    """(codes shape, scale/zero shape) of keys or values of ``shape`` [..., T, D] (already validated)."""
    *lead, T, D = shape
    return (*lead, T, fmt.code_dim(D, kind)), (*lead, *fmt.param_shape(kind, T, D))


def _check_out(out, kind: str, shape, fmt: QuantFormat, device) -> tuple:
    """out must be (codes uint8, scale float16, zero float16 or None for fp8) of the shapes of ``shape``."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ShapeError(f"out must be a tuple (codes, scale, zero), got {type(out).__name__}")
    codes_shape, params_shape = _expected_shapes(kind, shape, fmt)
    codes, scale, zero = out
    if not fmt.has_zero and zero is not None:
        raise ConfigError(f"{fmt} has no zero point: out's zero must be None, got {type(zero).__name__}")
    wanted = [("codes", codes, torch.uint8, codes_shape), ("scale", scale, torch.float16, params_shape)]
    if fmt.has_zero:
        wanted.append(("zero", zero, torch.float16, params_shape))
    for name, t, dtype, want in wanted:
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"out {name} must be a {dtype} torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise DTypeError(f"out {name} of {kind} ({fmt}) must be {dtype}, got {t.dtype}")
        if tuple(t.shape) != tuple(want):
            raise ShapeError(
                f"out {name} of {kind} {list(shape)} ({fmt}) must have shape {list(want)}, got {list(t.shape)}"
            )
        if t.device != device:
            raise DeviceError(f"out {name} is on {t.device}, {kind} on {device}")
    return codes, scale, zero


def _check_inputs(x, fmt, out, kind: str) -> tuple[int, int, int, int]:
    """Validate the Triton path's contract; return (B, H, T, D)."""
    _check_fmt(fmt)
    B, H, T, D = _check_x(x, kind)
    if kind == "keys" and T % fmt.group_size:
        raise ShapeError(
            f"keys hold {T} tokens, not a multiple of the group size {fmt.group_size} (remainder "
            f"{T % fmt.group_size})"
        )
    fmt.check_head_dim(D)
    if out is not None:
        _check_out(out, kind, (B, H, T, D), fmt, x.device)
    return B, H, T, D


def _new_out(kind: str, shape, fmt: QuantFormat, device) -> tuple:
    codes_shape, params_shape = _expected_shapes(kind, shape, fmt)
    codes = torch.empty(codes_shape, dtype=torch.uint8, device=device)
    scale = torch.empty(params_shape, dtype=torch.float16, device=device)
    zero = torch.empty(params_shape, dtype=torch.float16, device=device) if fmt.has_zero else None
    return codes, scale, zero


# ---------------------------------------------------------------------------------------------------
# Off CUDA
# ---------------------------------------------------------------------------------------------------


def quantize_off_cuda(x, fmt, out, kind: str, check: bool, positions=None, state=None):
    """The dispatchers' path off CUDA: :func:`_off_cuda`'s codes, copied into ``out`` when it is given (`positions`:
    the tokens' indices, for a turning key centre; `state`: the layer's, with the keys)."""
    if check:
        _check_fmt(fmt)
    result = kernels_for(fmt).encode(x, fmt, kind, positions, state)
    if out is None:
        return result
    codes, scale, zero = _check_out(out, kind, tuple(x.shape), fmt, x.device) if check else out
    codes.copy_(result[0])
    scale.copy_(result[1])
    if zero is not None:
        zero.copy_(result[2])
    return codes, scale, zero


def quantize_values_at_torch(x, fmt: QuantFormat, out, slots, state=None):
    """The twin of ``quantize_values_at`` (``kernels/dispatch.py``): the format's codes off CUDA (its CPU operator
    where it has one), then one ``scatter_`` per tensor."""
    for dst, part in zip(out, kernels_for(fmt).encode(x, fmt, "values", None, state), strict=True):
        if dst is not None:
            dst.scatter_(2, slots[..., None].expand(*part.shape), part)
    return out


def _check_at(x, fmt, out, slots) -> None:
    _check_fmt(fmt)
    B, H, T, D = _check_x(x, "values")
    fmt.check_head_dim(D)
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or tuple(slots.shape) != (B, H, T):
        raise ShapeError(
            f"slots must be an int64 tensor [B, H, T] = {[B, H, T]}, got "
            f"{getattr(slots, 'dtype', type(slots).__name__)} {list(getattr(slots, 'shape', []))}"
        )
    if slots.device != x.device:
        raise DeviceError(f"slots are on {slots.device}, values on {x.device}")
    rows = out[0].shape[2] if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) else T
    _check_out(out, "values", (B, H, rows, D), fmt, x.device)


# ---------------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------------


if triton is not None:
    # The twin's constants (quant_format): directed-rounding margin, scale floor, fp8 range.
    _MARGIN_C = tl.constexpr(_MARGIN)
    _ONE_PLUS_MARGIN_C = tl.constexpr(1.0 + _MARGIN)
    _TINY_C = tl.constexpr(_TINY)
    _HALF_TINY_C = tl.constexpr(_HALF_TINY)
    _FP8_MAX_C = tl.constexpr(FP8_MAX)

    @triton.jit
    def _e4m3_bits(y):
        """float32 y (|y| <= 448) -> int32 float8 e4m3fn byte, round to nearest even (torch's bytes)."""
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        # Normal (|y| >= 2**-6): rebias the exponent (127 -> 7: subtract 120 << 23), round the 23-bit
        # mantissa to 3 bits (add 0x7FFFF plus the lowest kept bit: ties to even), keep bits 20..;
        # a mantissa carry moves into the exponent. 448 = 0x43E00000 -> 0x7E.
        odd = (mag >> 20) & 1
        normal = (mag - (120 << 23) + 0x7FFFF + odd) >> 20
        # Subnormal (|y| < 2**-6, multiples of 2**-9): in |y| + 2**14 the float32 ulp is 2**-9, so the
        # (round-to-nearest-even) float add rounds |y| to the code; its low mantissa bits count the
        # multiples (0..8, and 8 is 2**-6, the smallest normal code 0x08).
        sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        code = tl.where(mag < (121 << 23), sub, normal)
        return tl.where(bits < 0, code | 0x80, code)

    @triton.jit
    def _int_params(lo, hi, QMAX: tl.constexpr):
        """The twin's _params_int: float16 (scale, zero) with zero <= lo, zero + QMAX * scale >= hi."""
        zero = (lo - tl.abs(lo) * _MARGIN_C - _TINY_C).to(tl.float16)
        span = hi - zero.to(tl.float32)
        scale = tl.math.div_rn(span, tl.zeros_like(span) + QMAX) * _ONE_PLUS_MARGIN_C + _HALF_TINY_C
        scale = tl.maximum(scale, _TINY_C).to(tl.float16)
        return scale, zero

    @triton.jit
    def _fp8_scale(amax):
        """The twin's _scale_fp8: float16 scale >= amax / 448."""
        scale = tl.math.div_rn(amax, tl.zeros_like(amax) + _FP8_MAX_C) * _ONE_PLUS_MARGIN_C + _HALF_TINY_C
        return tl.maximum(scale, _TINY_C).to(tl.float16)

    @triton.jit
    def _encode(x, scale, zero, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
        """float32 x with float32 (scale, zero) of its group -> int32 codes (zero unused for fp8)."""
        if IS_FP8:
            y = tl.math.div_rn(x, scale)
            y = tl.minimum(tl.maximum(y, -_FP8_MAX_C), _FP8_MAX_C)
            q = _e4m3_bits(y)
        else:
            q = tl.floor(tl.math.div_rn(x - zero, scale) + 0.5)
            q = tl.minimum(tl.maximum(q, 0.0), QMAX).to(tl.int32)
        return q

    @triton.jit
    def _quant_keys_kernel(
        X,
        C,
        S,
        Z,
        H,
        stride_xb,
        stride_xh,
        stride_xt,
        stride_xd,
        stride_cb,
        stride_ch,
        stride_ct,
        stride_cd,
        stride_sb,
        stride_sh,
        stride_st,
        stride_sd,
        stride_zb,
        stride_zh,
        stride_zt,
        stride_zd,
        P: tl.constexpr,
        G: tl.constexpr,
        BITS: tl.constexpr,
        PER: tl.constexpr,
        QMAX: tl.constexpr,
        IS_FP8: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        # Program (row * H + head, token group, byte chunk). Tile [BLOCK_G, PER, BLOCK_P]: element
        # [t, i, j] is token grp * G + t, channel i * P + j0 + j (byte j0 + j, part i).
        pid_bh = tl.program_id(0)
        grp = tl.program_id(1).to(tl.int64)
        pid_p = tl.program_id(2)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)

        offs_t = tl.arange(0, BLOCK_G)
        offs_i = tl.arange(0, PER)
        offs_j = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        t_ok = offs_t < G
        j_ok = offs_j < P
        tok = grp * G + offs_t.to(tl.int64)  # [BLOCK_G]
        ch = offs_i[:, None] * P + offs_j[None, :]  # [PER, BLOCK_P]
        m3 = t_ok[:, None, None] & j_ok[None, None, :]

        x_ptrs = (
            X + b * stride_xb + h * stride_xh + tok[:, None, None] * stride_xt + ch[None, :, :] * stride_xd
        )
        x = tl.load(x_ptrs, mask=m3, other=0.0).to(tl.float32)

        # Per channel over the group's tokens. Padded channels get a harmless range (masked stores).
        if IS_FP8:
            amax = tl.max(tl.where(m3, tl.abs(x), 0.0), axis=0)
            scale16 = _fp8_scale(amax)
            scale = scale16.to(tl.float32)
            q = _encode(x, scale[None, :, :], scale[None, :, :], QMAX, IS_FP8)
        else:
            lo = tl.min(tl.where(m3, x, float("inf")), axis=0)
            hi = tl.max(tl.where(m3, x, float("-inf")), axis=0)
            lo = tl.where(j_ok[None, :], lo, 0.0)
            hi = tl.where(j_ok[None, :], hi, 0.0)
            scale16, zero16 = _int_params(lo, hi, QMAX)
            scale = scale16.to(tl.float32)
            zero = zero16.to(tl.float32)
            q = _encode(x, scale[None, :, :], zero[None, :, :], QMAX, IS_FP8)
            z_ptrs = Z + b * stride_zb + h * stride_zh + grp * stride_zt + ch * stride_zd
            tl.store(z_ptrs, zero16, mask=j_ok[None, :])
        s_ptrs = S + b * stride_sb + h * stride_sh + grp * stride_st + ch * stride_sd
        tl.store(s_ptrs, scale16, mask=j_ok[None, :])

        # Pack: part i shifted by i * BITS; parts occupy disjoint bits, so the sum is their bitwise or.
        packed = tl.sum(q << (offs_i * BITS)[None, :, None], axis=1)  # [BLOCK_G, BLOCK_P]
        c_ptrs = C + b * stride_cb + h * stride_ch + tok[:, None] * stride_ct + offs_j[None, :] * stride_cd
        tl.store(c_ptrs, packed.to(tl.uint8), mask=t_ok[:, None] & j_ok[None, :])

    @triton.jit
    def _quant_values_kernel(
        X,
        C,
        S,
        Z,
        Slots,
        H,
        T,
        stride_xb,
        stride_xh,
        stride_xt,
        stride_xd,
        stride_cb,
        stride_ch,
        stride_ct,
        stride_cd,
        stride_sb,
        stride_sh,
        stride_st,
        stride_sd,
        stride_zb,
        stride_zh,
        stride_zt,
        stride_zd,
        stride_ib,
        stride_ih,
        stride_it,
        HAS_SLOTS: tl.constexpr,
        P: tl.constexpr,
        G: tl.constexpr,
        NG: tl.constexpr,
        BITS: tl.constexpr,
        PER: tl.constexpr,
        QMAX: tl.constexpr,
        IS_FP8: tl.constexpr,
        BLOCK_T: tl.constexpr,
        P_PAD: tl.constexpr,
    ):
        # Program (row * H + head, token block). Tile [BLOCK_T, PER, P_PAD]: element [t, i, j] is token
        # t0 + t, channel i * P + j (the packed order), in value group (i * P + j) // G. HAS_SLOTS (compile
        # time): token t of (b, h) is written to row Slots[b, h, t] of the outputs instead of row t.
        pid_bh = tl.program_id(0)
        pid_t = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)

        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_i = tl.arange(0, PER)
        offs_j = tl.arange(0, P_PAD)
        t_ok = offs_t < T
        j_ok = offs_j < P
        tok = offs_t.to(tl.int64)
        ch = offs_i[:, None] * P + offs_j[None, :]  # [PER, P_PAD]
        gid = ch // G
        m3 = t_ok[:, None, None] & j_ok[None, None, :]

        x_ptrs = (
            X + b * stride_xb + h * stride_xh + tok[:, None, None] * stride_xt + ch[None, :, :] * stride_xd
        )
        x = tl.load(x_ptrs, mask=m3, other=0.0).to(tl.float32)
        if HAS_SLOTS:
            tok = tl.load(Slots + b * stride_ib + h * stride_ih + offs_t.to(tl.int64) * stride_it, mask=t_ok, other=0)
            tok = tok.to(tl.int64)

        s_row = S + b * stride_sb + h * stride_sh + tok * stride_st  # [BLOCK_T]
        z_row = Z + b * stride_zb + h * stride_zh + tok * stride_zt
        # Per-channel float32 scale/zero of each element's group, filled group by group.
        scale_c = tl.full([BLOCK_T, PER, P_PAD], 1.0, tl.float32)
        zero_c = tl.zeros([BLOCK_T, PER, P_PAD], dtype=tl.float32)
        for g in range(NG):
            in_g = ((gid == g) & j_ok[None, :])[None, :, :]  # [1, PER, P_PAD]
            if IS_FP8:
                amax = tl.max(tl.max(tl.where(in_g, tl.abs(x), 0.0), axis=2), axis=1)  # [BLOCK_T]
                scale16 = _fp8_scale(amax)
            else:
                lo = tl.min(tl.min(tl.where(in_g, x, float("inf")), axis=2), axis=1)
                hi = tl.max(tl.max(tl.where(in_g, x, float("-inf")), axis=2), axis=1)
                scale16, zero16 = _int_params(lo, hi, QMAX)
                zero_c = tl.where(in_g, zero16.to(tl.float32)[:, None, None], zero_c)
                tl.store(z_row + g * stride_zd, zero16, mask=t_ok)
            scale_c = tl.where(in_g, scale16.to(tl.float32)[:, None, None], scale_c)
            tl.store(s_row + g * stride_sd, scale16, mask=t_ok)

        q = _encode(x, scale_c, zero_c, QMAX, IS_FP8)
        packed = tl.sum(q << (offs_i * BITS)[None, :, None], axis=1)  # [BLOCK_T, P_PAD]
        c_ptrs = C + b * stride_cb + h * stride_ch + tok[:, None] * stride_ct + offs_j[None, :] * stride_cd
        tl.store(c_ptrs, packed.to(tl.uint8), mask=t_ok[:, None] & j_ok[None, :])


def _prepare(x, fmt, out, kind: str, kernel, check: bool):
    if not check:
        shape = tuple(x.shape)
    else:
        if triton is None:
            raise KernelUnavailableError(f"quantize_{kind}_triton needs triton, which is not installed")
        shape = _check_inputs(x, fmt, out, kind)
        if not x.is_cuda and not _is_interpreted(kernel):
            raise KernelUnavailableError(
                f"quantize_{kind}_triton needs CUDA tensors (got {x.device}) or TRITON_INTERPRET=1 set before "
                f"import; use quantize_{kind}"
            )
    if out is None:
        out = _new_out(kind, shape, fmt, x.device)
    codes, scale, zero = out
    # fp8 has no zero point: the kernels never touch Z then, so pass scale in its place.
    zero_arg = scale if zero is None else zero
    return shape, (codes, scale, zero), zero_arg


def _strides(t) -> tuple[int, int, int, int]:
    return tuple(t.stride())


def quantize_keys_triton(x, fmt: QuantFormat, out=None, *, check: bool = True):
    """Keys [B, H, T, D] -> (codes, scale, zero) with the Triton kernel (see the module doc)."""
    (B, H, T, D), (codes, scale, zero), zero_arg = _prepare(x, fmt, out, "keys", _quant_keys_kernel, check)
    if B * H * T == 0:
        return codes, scale, zero
    per = fmt.per_byte
    P = D // per
    G = fmt.group_size
    block_g = triton.next_power_of_2(G)
    block_p = min(triton.next_power_of_2(P), max(1, KEY_TILE_ELEMENTS // (block_g * per)))
    grid = (B * H, T // G, triton.cdiv(P, block_p))
    _quant_keys_kernel[grid](
        x,
        codes,
        scale,
        zero_arg,
        H,
        *_strides(x),
        *_strides(codes),
        *_strides(scale),
        *_strides(zero_arg),
        P=P,
        G=G,
        BITS=fmt.code_bits,
        PER=per,
        QMAX=fmt.qmax,
        IS_FP8=fmt.is_float,
        BLOCK_G=block_g,
        BLOCK_P=block_p,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return codes, scale, zero


def quantize_values_triton(x, fmt: QuantFormat, out=None, *, check: bool = True):
    """Values [B, H, T, D] -> (codes, scale, zero) with the Triton kernel (see the module doc)."""
    (B, H, T, D), (codes, scale, zero), zero_arg = _prepare(
        x, fmt, out, "values", _quant_values_kernel, check
    )
    return _launch_values(x, fmt, codes, scale, zero, zero_arg, None)


def quantize_values_at_triton(x, fmt: QuantFormat, out, slots, *, check: bool = True):
    """Values [B, H, T, D] quantized into rows ``slots`` [B, H, T] of ``out`` with the Triton kernel (see
    ``quantize_values_at`` in ``kernels/dispatch.py``)."""
    if check:
        if triton is None:
            raise KernelUnavailableError("quantize_values_at_triton needs triton, which is not installed")
        _check_at(x, fmt, out, slots)
        if not x.is_cuda and not _is_interpreted(_quant_values_kernel):
            raise KernelUnavailableError(
                f"quantize_values_at_triton needs CUDA tensors (got {x.device}) or TRITON_INTERPRET=1 set before "
                "import; use quantize_values_at"
            )
    codes, scale, zero = out
    _launch_values(x, fmt, codes, scale, zero, scale if zero is None else zero, slots)
    return out


def _launch_values(x, fmt, codes, scale, zero, zero_arg, slots):
    B, H, T, D = x.shape
    if B * H * T == 0:
        return codes, scale, zero
    per = fmt.per_byte
    P = D // per
    p_pad = triton.next_power_of_2(P)
    block_t = min(triton.next_power_of_2(T), max(1, VALUE_TILE_ELEMENTS // (per * p_pad)))
    grid = (B * H, triton.cdiv(T, block_t))
    _quant_values_kernel[grid](
        x,
        codes,
        scale,
        zero_arg,
        codes if slots is None else slots,  # never read without slots (HAS_SLOTS=False)
        H,
        T,
        *_strides(x),
        *_strides(codes),
        *_strides(scale),
        *_strides(zero_arg),
        *((0, 0, 0) if slots is None else slots.stride()),
        HAS_SLOTS=slots is not None,
        P=P,
        G=fmt.group_size,
        NG=D // fmt.group_size,
        BITS=fmt.code_bits,
        PER=per,
        QMAX=fmt.qmax,
        IS_FP8=fmt.is_float,
        BLOCK_T=block_t,
        P_PAD=p_pad,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return codes, scale, zero
