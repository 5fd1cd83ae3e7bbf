"""The rotated formats' twins: bit streams, rotations, Lloyd-Max codebooks, quantize/dequantize error, and the
decode attention dispatcher's rotate-in / rotate-out against float64 attention over the dequantized K/V."""

import math

import pytest
import torch
from kernel_checks import reference

from hf_kvplus.errors import ConfigError
from hf_kvplus.kernels import rotated_format as rf
from hf_kvplus.kernels.dispatch import quantized_decode_attention
from hf_kvplus.kernels.quant_format import (
    PackedKV,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)
from hf_kvplus.kernels.rotated_format import (
    RotatedFormat,
    codebook,
    dequantize_rotated,
    lloyd_max,
    pack_bits,
    quantize_rotated,
    rotation,
    unpack_bits,
)

#: Mean squared error of the Lloyd-Max quantizer of a unit Gaussian at 1-4 bits (Max, 1960): a rotated unit
#: vector's coordinate is nearly Gaussian with variance 1/D, so D x its distortion comes close at D = 128.
GAUSSIAN_DISTORTION = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _randn(*shape, generator, dtype=None):
    """torch.randn from a CPU generator (the same numbers on every device), moved to torch's default device."""
    return torch.randn(*shape, generator=generator, dtype=dtype, device="cpu").to(torch.get_default_device())


@pytest.mark.parametrize("bits", rf.ROTATED_BITS)
def test_bit_stream_holds_code_c_at_bit_c_times_bits(bits):
    codes = torch.randint(0, 2**bits, (3, 2, 24), generator=torch.Generator().manual_seed(bits), device="cpu")
    codes = codes.to(torch.get_default_device())
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 24 * bits // 8)
    stream = [(int(byte) >> i) & 1 for byte in packed[1, 1] for i in range(8)]  # little-endian bits
    for c in range(24):
        assert sum(stream[c * bits + i] << i for i in range(bits)) == codes[1, 1, c]
    assert torch.equal(unpack_bits(packed, bits), codes)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_rotations_are_orthogonal_and_fixed_by_the_seed(head_dim):
    r = rotation(head_dim, 3).double()
    eye = torch.eye(head_dim, dtype=torch.float64, device=r.device)  # rotation's default device: the CPU
    torch.testing.assert_close(r @ r.T, eye, atol=1e-6, rtol=0)
    assert torch.equal(rf._make_rotation(head_dim, 3), rotation(head_dim, 3))
    assert not torch.allclose(rotation(head_dim, 3), rotation(head_dim, 4))
    # Every coordinate is mixed: no entry carries most of a column's weight.
    assert r.abs().max() < 0.6


@pytest.mark.parametrize("shape", [(1, 8, 32), (2, 4, 1, 32), (4, 2, 300, 32)])
def test_rotated_is_the_product_with_the_rotation_compiled_or_not(shape):
    # A decode step's token compiles to a product and a sum (fused by inductor); a prompt's many tokens, to a matmul.
    x = torch.randn(shape, dtype=torch.bfloat16)
    r = rotation(shape[-1], 5, x.device)
    want = x.double() @ r.double()
    torch._dynamo.reset()
    compiled = torch.compile(rf.rotated, fullgraph=True, backend="inductor")
    for got in (rf.rotated(x, r), compiled(x, r)):
        assert got.dtype == torch.float32 and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled(compiled(x, r), r.T), x.float(), atol=1e-5, rtol=1e-5)  # and back


def test_shipped_codebooks_are_what_the_run_time_routine_computes():
    for bits in (1, 2, 3, 4):
        shipped = torch.tensor(rf._shipped()["64"][str(bits)])
        torch.testing.assert_close(shipped, torch.tensor(lloyd_max(64, bits)), atol=1e-9, rtol=0)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebooks_reach_the_lloyd_max_distortion_of_a_rotated_coordinate(bits):
    d = 128
    centroids, boundaries = codebook(d, bits, torch.get_default_device())
    x = _randn(20000, d, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
    u = (x / x.norm(dim=-1, keepdim=True)).float()  # coordinates of uniform unit vectors
    mse = ((centroids[torch.bucketize(u, boundaries)] - u) ** 2).mean().item()
    assert mse * d == pytest.approx(GAUSSIAN_DISTORTION[bits], rel=0.05)
    # Optimal for the distribution: centroids are symmetric, and each is its cell's mean.
    torch.testing.assert_close(centroids, -centroids.flip(0))
    cells = torch.bucketize(u.flatten(), boundaries)
    means = torch.stack([u.flatten()[cells == i].mean() for i in range(2**bits)])
    torch.testing.assert_close(means, centroids, atol=3e-3 / math.sqrt(d), rtol=0.01)


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("bits", rf.ROTATED_BITS)
def test_quantize_keeps_the_norm_and_the_error_of_the_codebook(bits, head_dim):
    fmt = RotatedFormat(bits, bits)
    x = _randn(2, 3, 200, head_dim, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, 0] = 0  # a zero vector stays zero, not NaN
    codes, norms = quantize_rotated(x, fmt, "keys")
    assert codes.shape == (2, 3, 200, head_dim * bits // 8) and norms.shape == (2, 3, 200, 1)
    y = dequantize_rotated(codes, norms, fmt, "keys")
    assert torch.equal(y[0, 0, 0], torch.zeros(head_dim))
    live = x.norm(dim=-1) > 0
    # Re-normalized: the decoded vector has x's norm (float16 rounding of the stored norm).
    torch.testing.assert_close(y.norm(dim=-1)[live], x.norm(dim=-1)[live], rtol=1e-3, atol=0)
    relative = ((y - x).norm(dim=-1)[live] ** 2 / x.norm(dim=-1)[live] ** 2).mean().item()
    bound = 2 * GAUSSIAN_DISTORTION[bits] if bits < 8 else 1e-3
    assert relative < bound
    rotated = dequantize_rotated(codes, norms, fmt, "keys", rotated_space=True)
    torch.testing.assert_close(rotated, y @ rotation(head_dim, 0, y.device), atol=1e-5, rtol=1e-5)


def test_keys_and_values_take_their_own_bits_through_the_format_functions():
    fmt = RotatedFormat(4, 2, seed=5)
    x = torch.randn(1, 2, 16, 64)
    k, k_norm, k_zero = quantize_keys(x, fmt)
    v, v_norm, v_zero = quantize_values(x, fmt)
    assert k.shape[-1] == 32 and v.shape[-1] == 16 and k_zero is None and v_zero is None
    assert torch.equal(dequantize_keys(k, k_norm, None, fmt), dequantize_rotated(k, k_norm, fmt, "keys"))
    assert torch.equal(dequantize_values(v, v_norm, None, fmt), dequantize_rotated(v, v_norm, fmt, "values"))
    assert fmt.bytes_per_token(64) == 32 + 16 + 4
    assert fmt.side_formats() == (RotatedFormat(4, 4, 5), RotatedFormat(2, 2, 5))


@pytest.mark.parametrize("kwargs, match", [
    (dict(key_bits=5, value_bits=2), "key_bits must be one of"),
    (dict(key_bits=4, value_bits=0), "value_bits must be one of"),
    (dict(key_bits=True, value_bits=2), "got True"),
    (dict(key_bits=4, value_bits=2, seed=1.5), "seed must be an int"),
])  # fmt: skip
def test_bad_formats_are_refused_with_the_numbers(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RotatedFormat(**kwargs)
    with pytest.raises(ConfigError, match="head_dim 36 is not a multiple of 8"):
        RotatedFormat(4, 2).check_head_dim(36)


def _case(fmt, B, Hq, Hkv, T, D, R, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = _randn(B, Hq, D, generator=g)
    k, v = _randn(B, Hkv, T, D, generator=g), _randn(B, Hkv, T, D, generator=g)
    kc, kn, _ = quantize_keys(k, fmt)
    vc, vn, _ = quantize_values(v, fmt)
    packed = PackedKV(kc, kn, None, vc, vn, None)
    rk, rv = _randn(B, Hkv, R, D, generator=g), _randn(B, Hkv, R, D, generator=g)
    return q, packed, rk, rv, dequantize_keys(kc, kn, None, fmt), dequantize_values(vc, vn, None, fmt)


@pytest.mark.parametrize("chunk", [4096, 16])  # one chunk, and the online softmax over several
@pytest.mark.parametrize("bits", [(4, 2), (3, 2), (8, 8)])
def test_decode_attention_in_the_rotated_space_equals_attention_over_the_dequantized_keys(bits, chunk, monkeypatch):
    import hf_kvplus.kernels.quant_attention as qa

    monkeypatch.setattr(qa, "TWIN_CHUNK_TOKENS", chunk)
    fmt = RotatedFormat(*bits, seed=2)
    B, Hq, Hkv, T, D, R = 2, 4, 2, 40, 64, 5
    q, packed, rk, rv, k, v = _case(fmt, B, Hq, Hkv, T, D, R)
    start, length = 3, 30
    mask = torch.rand(B, length + R, generator=torch.Generator().manual_seed(1), device="cpu") > 0.2
    mask = mask.to(q.device)
    mask[:, -1] = True
    keys = torch.cat([k[:, :, start : start + length], rk], dim=2)
    values = torch.cat([v[:, :, start : start + length], rv], dim=2)
    want = reference(q, keys, values, 0.125, mask)
    kw = dict(start=start, length=length, scale=0.125, residual_k=rk, residual_v=rv, mask=mask)
    got = quantized_decode_attention(q, packed, fmt, **kw)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    out, mass = quantized_decode_attention(q, packed, fmt, **kw, with_mass=True)
    torch.testing.assert_close(out, got, atol=1e-6, rtol=1e-6)
    scores = torch.einsum("bhd,bhnd->bhn", q.double(), keys.repeat_interleave(Hq // Hkv, 1).double()) * 0.125
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    torch.testing.assert_close(mass.double(), probs.view(B, Hkv, -1, length + R).sum(2), atol=1e-5, rtol=1e-5)
