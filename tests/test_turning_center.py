"""The turning key centre: the position basis against RoPE computed independently (pairs as complex
numbers), the twins' codes relative to it against a format without a centre coding ``k - c(p)`` by hand, the
dispatcher's codes at a buffer index against the twin's, what it gains over a fixed centre on keys with a pre-RoPE
offset, and its typed errors. The decode kernels are checked with it beside the other centres
(test_rotated_attention_cpu.py, test_rotated_kernels.py); the caches in test_rotated_cache.py."""

from __future__ import annotations

import pytest
import torch

import hf_kvplus.kernels.custom_ops  # noqa: F401 - registers torch.ops.kvplus
from hf_kvplus.errors import ConfigError, ShapeError
from hf_kvplus.kernels.dispatch import quantize_keys
from hf_kvplus.kernels.rotated_format import (
    KeyCenter,
    RotatedFormat,
    dequantize_rotated,
    in_plane_order,
    quantize_rotated,
    rotation,
)
from hf_kvplus.kernels.turning_center import RotaryBasis

D, ROTARY, H = 64, 48, 3  # partial rotary: channels 48.. do not turn


def basis(rotary: int = ROTARY) -> RotaryBasis:
    return RotaryBasis(1.0 / 10000.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary), D)


def rope(x: torch.Tensor, positions: torch.Tensor, b: RotaryBasis) -> torch.Tensor:
    """x [..., T, D] turned to `positions` [T], rotate-half pairs as complex numbers (not the module's formula)."""
    h, r = b.rotary_dim // 2, b.rotary_dim
    z = torch.complex(x[..., :h].double(), x[..., h:r].double())
    turned = z * torch.exp(1j * positions.double()[:, None] * b.inv_freq)
    return torch.cat((turned.real, turned.imag, x[..., r:].double()), dim=-1).float()


def offset_keys(positions: torch.Tensor, b: RotaryBasis, offset: float = 3.0) -> torch.Tensor:
    """Keys [1, H, T, D]: a large pre-RoPE mean per head plus noise, turned to their positions."""
    g = torch.Generator().manual_seed(0)
    mu = offset * torch.randn(H, 1, D, generator=g)
    pre = mu + torch.randn(1, H, positions.numel(), D, generator=g)
    return rope(pre, positions, b)


def test_basis_rows_times_weights_turn_the_mean_as_rope_does():
    b = basis()
    mu, positions = torch.randn(H, D), torch.tensor([0, 1, 7, 300, 4095])
    by_basis = torch.einsum("td,hde->hte", b.rows(positions), b.weights(mu))
    torch.testing.assert_close(by_basis, rope(mu[:, None].expand(H, 5, D), positions, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(by_basis[..., ROTARY:], mu[:, None, ROTARY:].expand(H, 5, -1))  # the rest does not turn


def test_the_block_basis_turns_its_first_block_to_every_later_one():
    """`KeyCenter.block_basis` (what the C++ decode reads): the first block's columns, turned by block k's angles as
    RoPE turns a pair (complex multiplication), are `basis`'s columns of block k; the rows past the rotary dims are
    the same in every block; a second call returns the kept tables."""
    center, size, start, count = KeyCenter(basis(), origin=5), 16, 3, 70
    first, steps = center.block_basis(start, count, torch.device("cpu"), size)
    assert first.shape == (D, size) and steps.shape[1:] == (2, ROTARY // 2) and steps.shape[0] >= -(-count // size)
    full = center.basis(start + 5 * size, torch.device("cpu"))
    h = ROTARY // 2
    for k in range(5):
        turned = torch.complex(first[:h], first[h:ROTARY]) * torch.complex(steps[k, 0], steps[k, 1])[:, None]
        want = full[:, start + k * size : start + (k + 1) * size]
        torch.testing.assert_close(torch.cat((turned.real, turned.imag)), want[:ROTARY], atol=2e-6, rtol=0)
        assert torch.equal(first[ROTARY:], want[ROTARY:])
    again = center.block_basis(start, count, torch.device("cpu"), size)
    assert again[0] is first and again[1] is steps


def test_unturned_inverts_rope():
    b, positions = basis(), torch.arange(100, 140)
    x = torch.randn(2, H, 40, D)
    torch.testing.assert_close(b.unturned(rope(x, positions, b)[:, :, :, :], positions), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_relative_to_the_turned_centre(bits):
    """Each key is coded as c(p) + code(k - c(p)) where k - c(p) is shorter, else code(k): what a format without a
    centre makes of those vectors, with c the keys' pre-RoPE mean (of the first keys coded) turned to p."""
    b = basis()
    positions = torch.arange(5, 69)
    keys = offset_keys(positions, b)
    keys[:, :, 0] = -keys[:, :, 0] * 6  # far from the centre: coded plainly
    fmt, center = RotatedFormat(bits, bits, seed=3), KeyCenter(b)
    codes, norms = quantize_rotated(keys, fmt, "keys", positions, center)
    decoded = dequantize_rotated(codes, norms, fmt, "keys", positions=positions, center=center)

    mu = b.unturned(keys, positions).mean(dim=(0, 2))
    torch.testing.assert_close(center.mu, mu)
    c = rope(mu[:, None].expand(H, positions.numel(), D), positions, b)[None]
    plain = RotatedFormat(bits, bits, seed=3)

    def roundtrip(x):
        return dequantize_rotated(*quantize_rotated(x.contiguous(), plain, "keys"), plain, "keys")

    shorter = (keys - c).norm(dim=-1, keepdim=True) <= keys.norm(dim=-1, keepdim=True)
    expected = torch.where(shorter, c + roundtrip(keys - c), roundtrip(keys))
    assert not shorter[0, :, 0].any() and shorter[0, :, 1:].all()
    assert torch.equal(norms < 0, ~shorter)
    torch.testing.assert_close(decoded, expected, atol=1e-4, rtol=1e-4)

    r = rotation(D, 3)
    in_space = dequantize_rotated(codes, norms, fmt, "keys", rotated_space=True, positions=positions, center=center)
    torch.testing.assert_close(in_space, decoded @ r, atol=1e-4, rtol=1e-4)
    in_planes = dequantize_rotated(codes, norms, fmt, "keys", rotated_space=True, planes=True, positions=positions,
                                   center=center)  # fmt: skip
    torch.testing.assert_close(in_planes, in_plane_order(in_space, bits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_the_dispatcher_codes_at_a_buffer_index(cpu_kernels, monkeypatch):
    """`quantize_keys(..., index=e)` codes x as the twin does at indices e .. e + T - 1 (the C++ operator with the
    centre of each token, or the twin), and the first call sets the centre from those positions."""
    from hf_kvplus.kernels import rotated_cpu

    if not cpu_kernels:
        monkeypatch.setattr(rotated_cpu, "encodes", lambda x: False)
    b, positions = basis(), torch.arange(40, 72)
    keys = offset_keys(positions + 5, b)
    fmt, mine, twin = RotatedFormat(3, 2, seed=1), KeyCenter(b, 5), KeyCenter(b, 5)
    codes, norms, _ = quantize_keys(keys, fmt, check=False, index=40, state=mine)
    want_codes, want_norms = quantize_rotated(keys, fmt, "keys", positions, twin)
    torch.testing.assert_close(mine.mu, twin.mu)
    assert (codes != want_codes).float().mean() < 0.01  # a code at a boundary may round the other way
    torch.testing.assert_close(norms.float(), want_norms.float(), atol=0, rtol=2e-3)


def test_turning_centre_codes_offset_keys_closer_than_a_fixed_one():
    """Keys with a pre-RoPE mean over 2,048 positions: relative to the turning centre, 3-bit codes err less than
    relative to the keys' fixed (post-RoPE) mean."""
    b = basis(D)
    positions = torch.arange(2048)
    keys = offset_keys(positions, b)
    errors = {}
    for name, center in (("fixed", KeyCenter()), ("turning", KeyCenter(b))):
        fmt = RotatedFormat(3, 3, seed=0)
        args = {"positions": positions} if center.turns else {}
        codes, norms = quantize_rotated(keys, fmt, "keys", args.get("positions"), center)
        errors[name] = float((dequantize_rotated(codes, norms, fmt, "keys", **args, center=center) - keys).square().mean())
    assert errors["turning"] < 0.5 * errors["fixed"], errors


def test_typed_errors():
    b = basis()
    positions = torch.arange(8)
    keys = offset_keys(positions, b)
    fmt, center = RotatedFormat(4, 2), KeyCenter(b)
    with pytest.raises(ConfigError, match="positions"):
        quantize_rotated(keys, fmt, "keys", None, center)
    with pytest.raises(ShapeError, match=r"positions must be \[8\]"):
        quantize_rotated(keys, fmt, "keys", torch.arange(9), center)
    codes, norms = quantize_rotated(keys, fmt, "keys", positions, center)
    with pytest.raises(ConfigError, match="positions"):
        dequantize_rotated(codes, norms, fmt, "keys", center=center)
    with pytest.raises(ConfigError, match="on CUDA only"):  # the custom operator's CPU kernel
        v_codes, v_norms = quantize_rotated(keys, fmt, "values")
        torch.ops.kvplus.rotated_decode_attention(
            torch.randn(1, H, D), codes, norms, v_codes, v_norms, 4, 2, 0, 0, 8, 0.125, None, None, None, None, None,
            None, torch.randn(1, H, D), torch.randn(D, 8),
        )  # fmt: skip
    with pytest.raises(ConfigError, match="rotary dims"):
        RotaryBasis(torch.ones(40), D)
    with pytest.raises(ShapeError):
        b.weights(torch.randn(H, D + 8))
