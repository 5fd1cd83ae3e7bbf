"""Quantize-and-pack: the Triton kernels (under TRITON_INTERPRET=1) against the torch twins and float64.

Inputs are fresh random numbers each run (the seed is in failure messages), with planted hard cases:
an outlier channel (scaled by 100), a constant group, an all-zero group and a negative-only group.
Every test checks two things:

- bit equality with the twins of ``quant_format`` (codes, scales, zero points); fp8 codes may differ
  only in the sign of a zero code;
- the analytic error bound of the format against the float64 input, elementwise. Integers:
  ``|x - x^| <= scale / 2`` (the group's scale); fp8: ``|x - x^| <= |x| * 2**-4 + scale * 2**-10``.
  Both get a float32 term, ``2**-21 * (|x| + |zero|)``: the kernel divides and the dequantizer adds in
  float32, a few ulps of the operands (far below scale / 2, which is at least ``range * 2**-9``: a code
  off by one breaks the bound by a whole step).

Outputs given with ``out=`` are poisoned first (codes 0xAB, scales/zeros NaN) and live inside larger
buffers whose bytes outside the slice are checked unchanged.
"""

from __future__ import annotations

import pytest
import torch

import hf_kvplus.kernels.quant_pack as mod
from hf_kvplus.errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    KernelUnavailableError,
    KVPlusError,
    ShapeError,
)
from hf_kvplus.kernels import format_kernels, kivi_kernels, rotated_cpu
from hf_kvplus.kernels import quant_format as qf
from hf_kvplus.kernels.dispatch import quantize_keys, quantize_values, quantize_values_at
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.kernels.quant_pack import (
    quantize_keys_triton,
    quantize_values_at_triton,
    quantize_values_triton,
)

triton = pytest.importorskip("triton")
tl = triton.language

BITS = [8, 4, 2, "fp8"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POISON_BYTE = 0xAB


# ---------------------------------------------------------------------------------------------------
# Inputs and checks
# ---------------------------------------------------------------------------------------------------


def make_keys(B, H, T, D, G, dtype):
    """Random keys with an outlier channel and, in head 0, constant / zero / negative-only groups."""
    x = torch.randn(B, H, T, D, dtype=torch.float64)
    x[..., 5] *= 100.0  # outlier channel
    x[:, 0, :G, 7] = torch.randn(()).item() * 3  # constant group (channel 7, first group of tokens)
    x[:, 0, G : 2 * G, 9] = 0.0  # all-zero group
    x[:, 0, :, 11] = -(x[:, 0, :, 11].abs() + 0.5)  # negative-only groups
    return x.to(dtype)


def make_values(B, H, T, D, G, dtype):
    """Random values with an outlier channel and, in head 0, constant / zero / negative-only groups."""
    x = torch.randn(B, H, T, D, dtype=torch.float64)
    x[..., 5] *= 100.0  # outlier channel (in channel group 0)
    x[:, 0, 1, :G] = torch.randn(()).item() * 3  # constant group (token 1, channels 0..G-1)
    x[:, 0, 2, G : 2 * G] = 0.0  # all-zero group
    x[:, 0, 3, :] = -(x[:, 0, 3, :].abs() + 0.5)  # negative-only groups
    return x.to(dtype)


def same_fp8(a, b):
    """Equal bytes, or both a zero code (0x00 / 0x80)."""
    return (a == b) | (((a & 0x7F) == 0) & ((b & 0x7F) == 0))


def assert_matches_twin(got, want, fmt, seed, what):
    codes, scale, zero = got
    w_codes, w_scale, w_zero = want
    assert codes.dtype == torch.uint8 and codes.shape == w_codes.shape, what
    if fmt.is_float:
        bad = ~same_fp8(codes, w_codes)
        assert not bad.any(), f"{what}: {int(bad.sum())} fp8 codes differ from the twin (seed {seed})"
        assert zero is None
    else:
        bad = codes != w_codes
        assert not bad.any(), f"{what}: {int(bad.sum())} codes differ from the twin (seed {seed})"
        assert zero.dtype == torch.float16
        assert torch.equal(zero, w_zero), f"{what}: zero points differ from the twin (seed {seed})"
    assert scale.dtype == torch.float16
    assert torch.equal(scale, w_scale), f"{what}: scales differ from the twin (seed {seed})"


def per_element(params, kind, G):
    """Scale/zero [B, H, groups, D] (keys) or [B, H, T, groups] (values) broadcast to [B, H, T, D]."""
    return params.double().repeat_interleave(G, dim=-2 if kind == "keys" else -1)


def dequantize(kind, codes, scale, zero, fmt):
    fn = qf.dequantize_keys if kind == "keys" else qf.dequantize_values
    return fn(codes, scale, zero, fmt).double()


def assert_within_bound(kind, x, got, fmt, seed, what):
    """The analytic bound of the format, elementwise against the float64 input."""
    codes, scale, zero = got
    x = x.double()
    xh = dequantize(kind, codes, scale, zero, fmt)
    assert torch.isfinite(xh).all(), f"{what}: non-finite dequantized values (seed {seed})"
    s = per_element(scale, kind, fmt.group_size)
    err = (x - xh).abs()
    if fmt.is_float:
        bound = x.abs() * 2**-4 + s * 2**-10 + 2**-21 * x.abs() + 1e-12
    else:
        z = per_element(zero, kind, fmt.group_size)
        # The scale is rounded up to float16 (relative margin, plus half the subnormal spacing), so no
        # value is clamped: half a step, plus float32 rounding.
        bound = s / 2 * (1 + 1e-5) + 2**-21 * (x.abs() + z.abs()) + 1e-7
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error reaches {worst:.3g} x the analytic bound (seed {seed})"
    return xh


def run_both(kind, x, fmt, **kwargs):
    triton_fn = quantize_keys_triton if kind == "keys" else quantize_values_triton
    twin = qf.quantize_keys if kind == "keys" else qf.quantize_values
    return triton_fn(x, fmt, **kwargs), twin(x, fmt)


# ---------------------------------------------------------------------------------------------------
# Every format and dtype: bit-identical to the twin, within the bound, hard cases exact where they must be
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_keys_match_twin_and_bound(seed, bits, dtype):
    B, H, T, D, G = 1, 2, 32, 64, 16
    fmt = QuantFormat(bits, G)
    x = make_keys(B, H, T, D, G, dtype)
    got, want = run_both("keys", x, fmt)
    what = f"keys {fmt} {dtype}"
    assert_matches_twin(got, want, fmt, seed, what)
    xh = assert_within_bound("keys", x, got, fmt, seed, what)
    x64 = x.double()
    # All-zero group: exactly zero back (int: zero point -2**-24, one step of 2**-24).
    assert torch.equal(xh[:, 0, G : 2 * G, 9], torch.zeros_like(xh[:, 0, G : 2 * G, 9])), what
    if not fmt.is_float:
        # Constant group: only the float16 rounding of the zero point is left.
        c, ch = x64[:, 0, :G, 7], xh[:, 0, :G, 7]
        assert ((c - ch).abs() <= c.abs() * 2**-10 + 1e-7).all(), f"{what}: constant group (seed {seed})"
        # No value is clamped: the zero point sits below the min, the top code reaches the max.
        assert (got[2].double() <= x64.unflatten(2, (T // G, G)).amin(dim=3)).all(), what


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_values_match_twin_and_bound(seed, bits, dtype):
    B, H, T, D, G = 1, 2, 8, 64, 16
    fmt = QuantFormat(bits, G)
    x = make_values(B, H, T, D, G, dtype)
    got, want = run_both("values", x, fmt)
    what = f"values {fmt} {dtype}"
    assert_matches_twin(got, want, fmt, seed, what)
    xh = assert_within_bound("values", x, got, fmt, seed, what)
    x64 = x.double()
    assert torch.equal(xh[:, 0, 2, G : 2 * G], torch.zeros_like(xh[:, 0, 2, G : 2 * G])), what
    if not fmt.is_float:
        c, ch = x64[:, 0, 1, :G], xh[:, 0, 1, :G]
        assert ((c - ch).abs() <= c.abs() * 2**-10 + 1e-7).all(), f"{what}: constant group (seed {seed})"
        assert (got[2].double() <= x64.unflatten(3, (D // G, G)).amin(dim=4)).all(), what


@pytest.mark.parametrize(
    "kind, bits, B, H, T, D, G",
    [
        ("keys", 4, 1, 1, 18, 48, 6),  # group of 6 tokens, P = 24 bytes (padded to 32)
        ("keys", 2, 2, 1, 24, 96, 24),  # D = 96: P = 24 bytes
        ("values", 2, 1, 2, 5, 48, 12),  # value groups straddle the 4 parts of a byte (P = 12)
        ("values", 4, 2, 1, 6, 96, 32),  # 3 groups, P = 48 (padded to 64): neither holds the other
        ("values", 2, 1, 2, 5, 64, 32),  # a group holds two of the 4 parts of a byte (P = 16)
        ("values", "fp8", 1, 1, 7, 80, 16),
        ("keys", "fp8", 1, 1, 16, 80, 8),
    ],
)
def test_odd_shapes(seed, kind, bits, B, H, T, D, G):
    """Group sizes, head dims and token counts that are not powers of two (padded, masked tiles)."""
    fmt = QuantFormat(bits, G)
    x = (make_keys if kind == "keys" else make_values)(B, H, T, D, G, torch.float32)
    got, want = run_both(kind, x, fmt)
    assert_matches_twin(got, want, fmt, seed, f"{kind} {fmt} D={D} T={T}")
    assert_within_bound(kind, x, got, fmt, seed, f"{kind} {fmt} D={D} T={T}")


def test_values_many_token_blocks(seed):
    """More tokens than one program's block (several programs along T, the last one partial)."""
    fmt = QuantFormat(4, 32)
    assert 100 > mod.VALUE_TILE_ELEMENTS // 128 * 4, "the test needs several token blocks"
    x = make_values(1, 1, 100, 128, 32, torch.float16)
    got, want = run_both("values", x, fmt)
    assert_matches_twin(got, want, fmt, seed, "values 100 tokens")


def test_keys_many_byte_chunks(seed):
    """A key group too large for one tile is cut into chunks of bytes (several programs along P)."""
    fmt = QuantFormat(8, 128)
    assert 128 * 128 >= 2 * mod.KEY_TILE_ELEMENTS, "the test needs several byte chunks"
    x = make_keys(1, 1, 128, 128, 128, torch.float32)
    got, want = run_both("keys", x, fmt)
    assert_matches_twin(got, want, fmt, seed, "keys g128")
    assert_within_bound("keys", x, got, fmt, seed, "keys g128")


# ---------------------------------------------------------------------------------------------------
# Layout: channel order of the packed bytes, strided inputs, out= views
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_packed_channel_order(kind, bits):
    """Inputs whose codes are known: a pattern code(t, c); the bytes must be the documented packing.

    Each group holds a 0 and a qmax (keys: tokens 0 and 1; values: channels 0 and 1 of the group), so
    zero = -2**-24 and scale = f16(1 + 2**-10) = 1 + 2**-10 exactly, and an integer value k in
    0..qmax encodes to code k.
    """
    fmt = QuantFormat(bits, 8)
    qmax = fmt.qmax
    T, D = 16, 32
    t = torch.arange(T)[:, None]
    c = torch.arange(D)[None, :]
    want = (t * 5 + c * 3 + 1) % (qmax + 1)
    if kind == "keys":
        want[0::8, :], want[1::8, :] = 0, qmax
    else:
        want[:, 0::8], want[:, 1::8] = 0, qmax
    x = want.to(torch.float32).expand(1, 2, T, D)
    codes, scale, zero = (quantize_keys_triton if kind == "keys" else quantize_values_triton)(x, fmt)
    assert torch.equal(scale, torch.full_like(scale, 1 + 2**-10))
    assert torch.equal(zero, torch.full_like(zero, -(2**-24)))
    # The documented layout, built here independently of quant_format.pack_codes: byte j holds
    # channel i * P + j in bits i * bits .. (i + 1) * bits - 1.
    per, P = fmt.per_byte, D // fmt.per_byte
    packed = torch.zeros(T, P, dtype=torch.int64)
    for i in range(per):
        packed |= want[:, i * P : (i + 1) * P] << (i * bits)
    assert torch.equal(codes[0, 0].long(), packed), f"{kind} int{bits}: packed bytes"
    assert torch.equal(codes[0, 1].long(), packed)
    unpacked = qf.unpack_planes(codes, fmt).flatten(-2)
    assert int(unpacked.max()) <= qmax
    assert torch.equal(unpacked[0, 0].long(), want), f"{kind} int{bits}: unpacked channel order"


@pytest.mark.parametrize("kind", ["keys", "values"])
def test_strided_inputs(seed, kind):
    """x as a transposed view ([B, T, H, D] storage) and with a non-unit stride on the head dim."""
    fmt = QuantFormat(4, 16)
    base = (make_keys if kind == "keys" else make_values)(2, 2, 32, 64, 16, torch.float16)
    views = {
        "transposed": base.transpose(1, 2).contiguous().transpose(1, 2),
        "every other channel": torch.stack([base, -base], dim=-1).flatten(-2)[..., ::2],
    }
    for name, x in views.items():
        assert not x.is_contiguous() and torch.equal(x, base)
        got, want = run_both(kind, x, fmt)
        assert_matches_twin(got, want, fmt, seed, f"{kind} {name}")


@pytest.mark.parametrize(
    "bits, D, G",
    [(4, 64, 16), ("fp8", 64, 16), (2, 48, 12)],  # the last: 12 bytes per token, padded tiles
)
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_out_views_written_in_place(seed, kind, bits, D, G):
    """out= slices of larger buffers: every element written, nothing outside the slice touched.

    The buffers are longer along tokens (the slice starts at token t0) and wider along the last dim
    (the slice takes its first columns), so a write past a row's end or past the slice shows.
    """
    fmt = QuantFormat(bits, G)
    B, H, T, t0 = 2, 2, 2 * G, G
    T_MAX = T + 3 * G
    x = (make_keys if kind == "keys" else make_values)(B, H, T, D, G, torch.bfloat16)
    P = fmt.packed_dim(D)
    codes_buf = torch.full((B, H, T_MAX, P + 5), POISON_BYTE, dtype=torch.uint8)
    if kind == "keys":
        rows, cols, sl = T_MAX // G, D, slice(t0 // G, (t0 + T) // G)
    else:
        rows, cols, sl = T_MAX, D // G, slice(t0, t0 + T)
    scale_buf = torch.full((B, H, rows, cols + 3), float("nan"), dtype=torch.float16)
    zero_buf = None if fmt.is_float else torch.full_like(scale_buf, float("nan"))
    out = (
        codes_buf[:, :, t0 : t0 + T, :P],
        scale_buf[:, :, sl, :cols],
        None if zero_buf is None else zero_buf[:, :, sl, :cols],
    )
    assert not out[0].is_contiguous() and not out[1].is_contiguous()

    got, want = run_both(kind, x, fmt, out=out)
    assert all(g is o for g, o in zip(got, out, strict=True)), "out's tensors are returned"
    assert_matches_twin(got, want, fmt, seed, f"{kind} {fmt} out=")
    assert not torch.isnan(got[1]).any()

    inside = torch.zeros(codes_buf.shape[2:], dtype=torch.bool)
    inside[t0 : t0 + T, :P] = True
    assert (codes_buf[:, :, ~inside] == POISON_BYTE).all(), "codes written outside the slice"
    inside = torch.zeros(scale_buf.shape[2:], dtype=torch.bool)
    inside[sl, :cols] = True
    for buf in (scale_buf, zero_buf):
        if buf is not None:
            assert torch.isnan(buf[:, :, ~inside]).all(), "scales/zeros written outside the slice"


def test_empty_token_range():
    fmt = QuantFormat(4, 16)
    codes, scale, zero = quantize_values_triton(torch.randn(1, 2, 0, 64), fmt)
    assert codes.shape == (1, 2, 0, 32) and scale.shape == zero.shape == (1, 2, 0, 4)
    codes, scale, zero = quantize_keys_triton(torch.randn(1, 2, 0, 64), fmt)
    assert codes.shape == (1, 2, 0, 32) and scale.shape == (1, 2, 0, 64)


# ---------------------------------------------------------------------------------------------------
# The e4m3 encoder against torch's float8_e4m3fn conversion
# ---------------------------------------------------------------------------------------------------


if getattr(mod, "_e4m3_bits", None) is not None:

    @triton.jit
    def _e4m3_probe(Y, Out, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        y = tl.load(Y + offs, mask=ok, other=0.0)
        tl.store(Out + offs, mod._e4m3_bits(y).to(tl.uint8), mask=ok)


def e4m3_probe_values() -> torch.Tensor:
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()  # all finite codes, +-0
    pos = every[every > 0].unique()
    mids = (pos[1:] + pos[:-1]) / 2  # exact in float32: ties, rounded to the even code
    mids = torch.cat([mids, torch.tensor([pos[0] / 2, 3 * pos[0] / 2])])  # 2**-10 (tie with 0), 3 * 2**-10
    inf = torch.tensor(float("inf"))
    near = torch.cat([torch.nextafter(mids, inf), torch.nextafter(mids, -inf), torch.nextafter(pos, -inf)])
    rand = torch.exp2(torch.empty(4096).uniform_(-12.0, 8.8)).clamp_max(448.0)  # log-uniform magnitudes
    special = torch.tensor([0.0, 1e-30, 1e-40, 2.0**-11, 2.0**-6, 447.99, 448.0, 432.0, 440.0, 3.3e-3])
    y = torch.cat([every, mids, near, rand, special])
    return torch.cat([y, -y])


def test_e4m3_encoder_matches_torch(seed):
    y = e4m3_probe_values()
    out = torch.full(y.shape, POISON_BYTE, dtype=torch.uint8)
    _e4m3_probe[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), BLOCK=1024)
    want = y.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = out != want
    assert not bad.any(), (
        f"{int(bad.sum())} of {y.numel()} e4m3 codes differ, e.g. {y[bad][:5].tolist()} -> "
        f"{out[bad][:5].tolist()}, torch {want[bad][:5].tolist()} (seed {seed})"
    )
    assert out[y.signbit() & (y == 0)].eq(0x80).all(), "-0.0 -> 0x80, as torch"


# ---------------------------------------------------------------------------------------------------
# Errors, dispatch, availability
# ---------------------------------------------------------------------------------------------------


def _outs(kind, B, H, T, D, fmt, **override):
    codes_shape, params_shape = mod._expected_shapes(kind, (B, H, T, D), fmt)
    out = {
        "codes": torch.empty(codes_shape, dtype=torch.uint8),
        "scale": torch.empty(params_shape, dtype=torch.float16),
        "zero": None if fmt.is_float else torch.empty(params_shape, dtype=torch.float16),
    }
    out.update(override)
    return out["codes"], out["scale"], out["zero"]


@pytest.mark.parametrize("fn", [quantize_keys_triton, quantize_values_triton, quantize_keys, quantize_values])
def test_errors(fn):
    kind = "keys" if fn in (quantize_keys_triton, quantize_keys) else "values"
    fmt = QuantFormat(4, 16)
    x = torch.randn(1, 2, 32, 64)
    cases = [
        (torch.randint(0, 5, (1, 2, 32, 64)), DTypeError, "int64"),
        ("not a tensor", DTypeError, "str"),
        (torch.randn(1, 2, 32, 64), ConfigError, "QuantFormat"),  # fmt below is a tuple
        (torch.randn(1, 2, 32, 40), ConfigError, "group_size 16 does not divide head_dim 40"),
        (x, DTypeError, "int8", {"codes": torch.empty(1, 2, 32, 32, dtype=torch.int8)}),
        (x, DTypeError, "float32", {"scale": torch.empty(_outs(kind, 1, 2, 32, 64, fmt)[1].shape)}),
        (x, ShapeError, "33", {"codes": torch.empty(1, 2, 32, 33, dtype=torch.uint8)}),
        (x, DTypeError, "NoneType", {"zero": None}),
        (x, DeviceError, "meta", {"codes": torch.empty(1, 2, 32, 32, dtype=torch.uint8, device="meta")}),
    ]
    if kind == "keys":
        cases.append(
            (torch.randn(1, 2, 20, 64), ShapeError, "20 tokens, not a multiple of the group size 16")
        )
    if fn in (quantize_keys_triton, quantize_values_triton):
        cases.append((torch.randn(2, 32, 64), ShapeError, "4 dims"))
    for x_in, err, match, *override in cases:
        f = (1, 2) if match == "QuantFormat" else fmt
        out = _outs(kind, *x.shape, fmt, **override[0]) if override else None
        with pytest.raises(err, match=match) as info:
            fn(x_in, f, out=out)
        assert isinstance(info.value, KVPlusError)
    fp8 = QuantFormat("fp8", 16)
    with pytest.raises(ConfigError, match="no zero point"):
        fn(x, fp8, out=_outs(kind, *x.shape, fp8, zero=torch.empty(1)))
    with pytest.raises(ShapeError, match="tuple"):
        fn(x, fmt, out=_outs(kind, *x.shape, fmt)[:2])


@pytest.mark.usefixtures("on_cpu")
def test_dispatcher_uses_torch_twin_on_cpu(seed, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(kivi_kernels, "quantize_keys_triton", boom)
    monkeypatch.setattr(kivi_kernels, "quantize_values_triton", boom)
    for bits in (2, "fp8"):
        fmt = QuantFormat(bits, 8)
        x = torch.randn(3, 16, 32)  # the twin takes any leading dims
        for kind, fn, twin in (
            ("keys", quantize_keys, qf.quantize_keys),
            ("values", quantize_values, qf.quantize_values),
        ):
            want = twin(x, fmt)
            assert_matches_twin(fn(x, fmt), want, fmt, seed, f"dispatch {kind}")
            codes_shape, params_shape = mod._expected_shapes(kind, x.shape, fmt)
            out = (
                torch.full(codes_shape, POISON_BYTE, dtype=torch.uint8),
                torch.full(params_shape, float("nan"), dtype=torch.float16),
                None if fmt.is_float else torch.full(params_shape, float("nan"), dtype=torch.float16),
            )
            got = fn(x, fmt, out=out)
            assert all(g is o for g, o in zip(got, out, strict=True))
            assert_matches_twin(got, want, fmt, seed, f"dispatch {kind} out=")


@pytest.mark.usefixtures("on_cpu")
def test_triton_unavailable(monkeypatch):
    x = torch.randn(1, 1, 16, 32)
    fmt = QuantFormat(4, 16)
    monkeypatch.setattr(mod, "_is_interpreted", lambda fn: False)
    for fn in (quantize_keys_triton, quantize_values_triton):
        with pytest.raises(KernelUnavailableError, match="cpu"):
            fn(x, fmt)
    monkeypatch.setattr(mod, "triton", None)
    for fn in (quantize_keys_triton, quantize_values_triton):
        with pytest.raises(KernelUnavailableError, match="triton"):
            fn(x, fmt)


# ---------------------------------------------------------------------------------------------------
# Quantizing into given slots (an evicting cache's refilled hole)
# ---------------------------------------------------------------------------------------------------


def _slot_buffers(fmt, B, H, N, D):
    """Slot buffers [B, H, N, ...] as views into larger ones (channel-padded codes, row-offset scales), poisoned."""
    per, G = fmt.per_byte, fmt.group_size
    codes = torch.full((B, H, N, D // per + 3), 0xAB, dtype=torch.uint8)[..., 1 : 1 + D // per]
    scale = torch.full((B, H, N + 2, D // G), float("nan"), dtype=torch.float16)[:, :, 1 : 1 + N]
    zero = None if fmt.is_float else torch.full((B, H, N + 2, D // G), float("nan"), dtype=torch.float16)[:, :, 2:]
    return codes, scale, zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
@pytest.mark.parametrize("fn", [quantize_values_at_triton, quantize_values_at], ids=["triton", "twin"])
def test_quantize_values_at_writes_exactly_the_slots(seed, fn, bits, dtype):
    """Each token's codes, scales and zeros land in its slot, equal to `quantize_values` of that token; every other
    slot keeps its bits (the kernel runs under the interpreter; the dispatcher takes the twin on CPU)."""
    fmt = QuantFormat(bits, 16)
    B, H, T, N, D = 2, 3, 2, 9, 48
    x = torch.randn(B, H, T, D + 4).to(dtype)[..., 2 : 2 + D]  # strided input
    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T)
    out = _slot_buffers(fmt, B, H, N, D)
    before = [None if t is None else t.clone() for t in out]
    assert fn(x, fmt, out, slots) is out
    want = quantize_values(x, fmt)
    written = torch.zeros(B, H, N, dtype=torch.bool).scatter_(2, slots, True)
    for got, old, ref in zip(out, before, want, strict=True):
        if got is None:
            assert ref is None
            continue
        at = got.gather(2, slots[..., None].expand(*ref.shape))
        assert torch.equal(at.view(torch.uint8), ref.view(torch.uint8)), f"{fmt} (seed {seed})"
        assert torch.equal(got[~written].view(torch.uint8), old[~written].view(torch.uint8)), "a slot not asked for"


def test_quantize_values_at_validates_its_inputs():
    fmt = QuantFormat(4, 16)
    x = torch.randn(1, 2, 1, 32)
    out = _slot_buffers(fmt, 1, 2, 5, 32)
    with pytest.raises(ShapeError, match=r"slots must be an int64 tensor \[B, H, T\] = \[1, 2, 1\]"):
        quantize_values_at(x, fmt, out, torch.zeros(1, 2, 1, dtype=torch.int32))
    with pytest.raises(ShapeError, match=r"slots must be an int64 tensor"):
        quantize_values_at(x, fmt, out, torch.zeros(1, 2, dtype=torch.int64))
    bad = (out[0][..., :-1], out[1], out[2])
    with pytest.raises(ShapeError, match="out codes"):
        quantize_values_at(x, fmt, bad, torch.zeros(1, 2, 1, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------
# The C++ encode operator on the CPU (kernels/kivi_cpu.py): bit for bit the twins
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def encode_op(monkeypatch):
    """CPU tensors, the operator built, and the twins made to fail inside the dispatcher: what runs is the operator."""
    if not rotated_cpu.available():
        pytest.skip("no C++ toolchain here: the CPU operators cannot be built (the twins' tests cover this path)")

    def boom(*args, **kwargs):
        raise AssertionError("the twin ran where the CPU operator should have")

    monkeypatch.setattr(format_kernels, "quantize_keys", boom)
    monkeypatch.setattr(format_kernels, "quantize_values", boom)
    with torch.device("cpu"):
        yield


@pytest.mark.usefixtures("encode_op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
@pytest.mark.parametrize(("G", "D", "T"), [(8, 32, 16), (32, 64, 64), (16, 48, 32)])
def test_encode_op_equals_twin(seed, bits, dtype, G, D, T):
    # Codes, scales and zeros equal the twins' bits: wide and tiny ranges, constant and zero groups, strided input.
    fmt = QuantFormat(bits, G)
    x = torch.randn(2, 3, T, D + 2)[..., 1 : 1 + D] * torch.tensor([1.0, 1e-4, 300.0]).view(1, 3, 1, 1)
    x[0, 0, :G] = 0.0
    x[1, 0, :, :G] = 2.5
    x = x.to(dtype)
    for kind, fn, twin in (("keys", quantize_keys, qf.quantize_keys), ("values", quantize_values, qf.quantize_values)):
        got, want = fn(x, fmt), twin(x, fmt)
        for g, w, name in zip(got, want, ("codes", "scale", "zero"), strict=True):
            assert (g is None) == (w is None), name
            assert g is None or torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{fmt} {kind} {name} (seed {seed})"


@pytest.mark.usefixtures("encode_op")
def test_encode_op_writes_slots_and_refuses_what_the_twin_refuses(seed):
    fmt = QuantFormat(4, 16)
    B, H, T, N, D = 2, 3, 2, 9, 48
    x = torch.randn(B, H, T, D)
    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T)
    out = _slot_buffers(fmt, B, H, N, D)
    quantize_values_at(x, fmt, out, slots)
    for got, ref in zip(out, qf.quantize_values(x, fmt), strict=True):
        assert torch.equal(got.gather(2, slots[..., None].expand(*ref.shape)).view(torch.uint8), ref.view(torch.uint8))
    with pytest.raises(ShapeError, match="20 tokens, not a multiple of the group size 16"):
        quantize_keys(torch.randn(1, 2, 20, 64), fmt)
    with pytest.raises(ConfigError, match="group_size 16 does not divide head_dim 40"):
        quantize_values(torch.randn(1, 2, 20, 40), fmt)


@pytest.mark.usefixtures("encode_op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
def test_values_into_equals_guard_then_twin(seed, bits, dtype):
    # The operator that codes an evicting cache's decode token straight into its slots: at given rows or a span, the
    # values RangeGuard zeroes (NaN, inf, beyond the limit) zeroed and counted, every other bit the twin's.
    from hf_kvplus.kernels.dispatch import quantize_values_into, takes_values_into
    from hf_kvplus.storage.value_range import RangeGuard

    fmt = QuantFormat(bits, 16)
    B, H, T, N, D = 2, 3, 2, 9, 48
    x = (torch.randn(B, H, T, D) * 3).to(dtype)
    x[0, 1, 1, 5], x[1, 2, 0, 7], x[1, 0, 1, 40] = float("nan"), float("inf"), 1e30 if dtype != torch.float16 else 6e4
    assert takes_values_into(x, fmt)
    guard = RangeGuard(*fmt.code_limit())
    want = qf.quantize_values(guard(x), fmt)
    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T)
    for rows in (slots, None):
        out, counted = _slot_buffers(fmt, B, H, N, D), torch.zeros((), dtype=torch.long)
        limit = min(guard.limit, torch.finfo(dtype).max)
        quantize_values_into(x, fmt, out, 3, rows, limit=limit, bad=counted)
        at = (slots if rows is not None else torch.arange(3, 3 + T).expand(B, H, T))[..., None]
        _assert_slots_hold(out, want, at, f"{fmt} {dtype} (seed {seed})")
        assert int(counted) == int(guard.pending) >= 2
    with pytest.raises(RuntimeError, match="rows 8..9 of 9"):
        quantize_values_into(x.float(), fmt, _slot_buffers(fmt, B, H, N, D), 8)
    assert not takes_values_into(x.to("meta"), fmt)


def _assert_slots_hold(out, want, at, message):
    """Each coded tensor of `out`, read at slots `at` [B, H, T, 1], holds the bytes of `want`'s (None where it has none)."""
    for got, ref in zip(out, want, strict=True):
        if ref is None:
            assert got is None
            continue
        got = got.gather(2, at.expand(*at.shape[:3], ref.shape[-1]))
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), message


@pytest.mark.usefixtures("encode_op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k_bits", "v_bits"), [(8, 8), (4, 4), (2, 2), ("fp8", "fp8"), (4, 2)])
@pytest.mark.parametrize(("T", "Dk", "Dv"), [(1, 48, 48), (3, 64, 32)])
def test_kv_into_equals_guard_then_twin_per_side(seed, k_bits, v_bits, dtype, T, Dk, Dv, monkeypatch):
    # Keys and values coded into their slots by one operator call (one format) or one per side (two): at given rows or
    # a span, each side's bits the guarded twin's, and what the guard zeroes on both sides counted once each.
    from hf_kvplus.kernels import kivi_cpu
    from hf_kvplus.kernels.dispatch import quantize_kv_into
    from hf_kvplus.storage.value_range import RangeGuard

    fk, fv = QuantFormat(k_bits, 16), QuantFormat(v_bits, 16)
    B, H, N = 2, 3, 9
    k, v = (torch.randn(B, H, T, Dk) * 3).to(dtype), (torch.randn(B, H, T, Dv) * 3).to(dtype)
    k[0, 1, 0, 5], v[1, 2, T - 1, 7], v[1, 0, 0, 20] = float("nan"), float("inf"), -1e30
    guard = RangeGuard(*fk.code_limit())
    want_k, want_v = qf.quantize_values(guard(k), fk), qf.quantize_values(guard(v), fv)
    ops = []
    real = kivi_cpu.kivi_encode_kv_into_cpu
    monkeypatch.setattr(kivi_cpu, "kivi_encode_kv_into_cpu", lambda *a, **kw: ops.append(1) or real(*a, **kw))
    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T)
    for rows in (slots, None):
        out_k, out_v = _slot_buffers(fk, B, H, N, Dk), _slot_buffers(fv, B, H, N, Dv)
        counted = torch.zeros((), dtype=torch.long)
        limit = min(guard.limit, torch.finfo(dtype).max)
        quantize_kv_into(k, v, (fk, fv), out_k, out_v, 5, rows, limit=limit, bad=counted)
        at = (slots if rows is not None else torch.arange(5, 5 + T).expand(B, H, T))[..., None]
        for out, want in ((out_k, want_k), (out_v, want_v)):
            _assert_slots_hold(out, want, at, f"{fk}/{fv} {dtype} (seed {seed})")
        assert int(counted) == 3
    assert len(ops) == (2 if fk == fv else 0)
    with pytest.raises(RuntimeError, match=f"rows {N - T + 1}..{N} of {N}"):
        out_k, out_v = _slot_buffers(fk, B, H, N, Dk), _slot_buffers(fk, B, H, N, Dv)
        quantize_kv_into(k.float(), v.float(), (fk, fk), out_k, out_v, N - T + 1)
