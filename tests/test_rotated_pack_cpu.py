"""The rotated formats' C++ quantize-and-pack on the CPU (``torch.ops.hf_kvplus_cpu.rotated_encode``).

The operator is checked against the twin (``rotated_format.quantize_rotated``, the format's definition) for every
bit width and head dims with the Hadamard and the Haar rotation: plain and centred sides (both signs of norm, the
centre set by the first call in both), rotated inputs, zero vectors and strided input. Then that the dispatchers
(``quant_pack``) code CPU tensors with it, eager and compiled (one node of the graph), that bad input gets an error
naming the numbers, and that without it the twin runs.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_rotated_attention_cpu import needs_operator

from hf_kvplus.kernels import dispatch, rotated_cpu
from hf_kvplus.kernels.rotated_format import (
    KeyCenter,
    RotatedFormat,
    codebook,
    dequantize_rotated,
    quantize_rotated,
    rotation,
)

pytestmark = needs_operator


@pytest.fixture(autouse=True)
def built():
    assert rotated_cpu.available()


def keys_like(B=2, H=3, T=40, D=32, seed=0) -> torch.Tensor:
    """Keys around a per-head offset (a centred side codes most relative to it), with far-off tokens (coded plain),
    and a zero vector."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) + 2 * torch.randn(H, 1, D, generator=g)
    x[:, :, :3] = 6 * torch.randn(B, H, 3, D, generator=g)
    x[0, 0, 5] = 0.0
    return x


def centred(fmt_bits=(4, 2), seed=3) -> tuple[RotatedFormat, KeyCenter]:
    """A format and a key centre, unset, as a cache's layer holds them."""
    return RotatedFormat(*fmt_bits, seed=seed), KeyCenter()


def assert_same_codes(got, want):
    """Codes alike, and norms within one float16 step (their sums of squares are added in another order). A coordinate
    within float rounding of a codebook boundary may take the next code where the twin's rotation (a BLAS product)
    rounds otherwise: none does on the machine these tests were written on, and at most one byte of at most 1% of the
    tokens may differ elsewhere (their norms then differ too)."""
    (codes, norms), (codes_twin, norms_twin) = got, want
    assert codes.dtype == torch.uint8 and norms.dtype == torch.float16
    assert codes.shape == codes_twin.shape and norms.shape == norms_twin.shape
    differing = (codes != codes_twin).sum(-1, keepdim=True)
    assert differing.max() <= 1 and (differing > 0).float().mean() <= 0.01, int((differing > 0).sum())
    alike = differing == 0
    torch.testing.assert_close(norms.float()[alike], norms_twin.float()[alike], atol=0, rtol=1e-3)
    assert torch.equal(norms < 0, norms_twin < 0)


@pytest.mark.parametrize("D", [32, 40, 48, 64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("side", ["keys", "values"])
def test_the_operator_codes_as_the_twin(D, bits, side):
    x = keys_like(D=D)
    fmt = RotatedFormat(bits, bits, seed=5)
    assert_same_codes(rotated_cpu.rotated_encode_cpu(x, fmt, side), quantize_rotated(x, fmt, side))


@pytest.mark.parametrize("D,bits", [(32, 4), (32, 3), (64, 2), (40, 4), (128, 1)])
def test_a_centred_side_codes_both_signs_as_the_twin(D, bits):
    x = keys_like(D=D)
    (fmt, ours), (_, twins) = centred((bits, 2)), centred((bits, 2))
    got = rotated_cpu.rotated_encode_cpu(x, fmt, "keys", None, ours)  # the first call sets the centre, as the twin's
    want = quantize_rotated(x, fmt, "keys", None, twins)
    torch.testing.assert_close(ours.mu, twins.mu, atol=0, rtol=0)
    assert_same_codes(got, want)
    norms = got[1]
    assert (norms > 0).any() and (norms < 0).any()  # centred and plain codes both made
    assert norms[0, 0, 5].item() == -(2.0**-24)  # the zero vector: plain, at the smallest norm
    later = keys_like(D=D, seed=1)  # the centre stays as the first call set it
    assert_same_codes(rotated_cpu.rotated_encode_cpu(later, fmt, "keys", None, ours),
                      quantize_rotated(later, fmt, "keys", None, twins))  # fmt: skip


def test_rotated_inputs_code_as_the_twin():
    fmt, center = centred((3, 3))
    x = keys_like(D=64)
    quantize_rotated(x, fmt, "keys", None, center)  # sets the centre
    turned = fmt.with_rotated_inputs()
    xr = x @ rotation(64, fmt.seed)
    assert_same_codes(rotated_cpu.rotated_encode_cpu(xr, turned, "keys", None, center),
                      quantize_rotated(xr, turned, "keys", None, center))  # fmt: skip
    plain = RotatedFormat(2, 4, seed=1).with_rotated_inputs()
    assert_same_codes(rotated_cpu.rotated_encode_cpu(xr, plain, "values"), quantize_rotated(xr, plain, "values"))


def test_strided_and_half_inputs_code_as_the_twin():
    fmt = RotatedFormat(4, 2, seed=0)
    x = keys_like(T=20, D=64).transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, T, D] with H outermost-but-one
    assert not x.is_contiguous()
    assert_same_codes(rotated_cpu.rotated_encode_cpu(x, fmt, "keys"), quantize_rotated(x, fmt, "keys"))
    h = keys_like(T=20, D=64).half()
    assert_same_codes(rotated_cpu.rotated_encode_cpu(h, fmt, "values"), quantize_rotated(h, fmt, "values"))


def test_decoded_codes_keep_the_length_and_stay_close():
    """Independently of the twin: the decoded vector has x's length (re-normalized) and a 4-bit code's error is small."""
    fmt = RotatedFormat(4, 4, seed=2)
    x = keys_like(D=128)
    codes, norms = rotated_cpu.rotated_encode_cpu(x, fmt, "keys")
    back = dequantize_rotated(codes, norms, fmt, "keys")
    torch.testing.assert_close(back.norm(dim=-1), x.norm(dim=-1), atol=1e-3, rtol=2e-3)
    relative = (back - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)
    assert relative[x.norm(dim=-1) > 0].max() < 0.15


@pytest.mark.parametrize("kind", ["keys", "values"])
def test_the_dispatchers_code_cpu_tensors_with_the_operator(monkeypatch, kind):
    fmt = RotatedFormat(4, 2, seed=0)
    x = keys_like(D=32)
    calls = []
    real = rotated_cpu.rotated_encode_cpu
    monkeypatch.setattr(rotated_cpu, "rotated_encode_cpu", lambda *a: calls.append(a[2]) or real(*a))
    quantize = dispatch.quantize_keys if kind == "keys" else dispatch.quantize_values
    out = tuple(torch.zeros_like(t) for t in quantize_rotated(x, fmt, kind))
    codes, norms, zero = quantize(x, fmt, out=(*out, None))
    assert calls == [kind] and zero is None and codes is out[0]
    assert_same_codes((codes, norms), quantize_rotated(x, fmt, kind))
    slots = torch.tensor([[[3, 0]] * 3] * 2)  # [B, H, T=2]
    want = quantize_rotated(x[:, :, :2], fmt, "values")
    buffers = tuple(torch.zeros(2, 3, 5, t.shape[-1], dtype=t.dtype) for t in want)
    dispatch.quantize_values_at(x[:, :, :2], fmt, (*buffers, None), slots)
    assert calls == [kind, "values"]
    for buffer, part in zip(buffers, want, strict=True):
        assert torch.equal(buffer[:, :, 3], part[:, :, 0]) and torch.equal(buffer[:, :, 0], part[:, :, 1])
        assert not buffer[:, :, [1, 2, 4]].any()
    monkeypatch.setattr(rotated_cpu, "_LOADED", False)  # as where it cannot be built: the twin
    quantize(x, fmt)
    assert len(calls) == 2


def test_a_compiled_call_is_one_node_of_the_graph():
    fmt, center = centred((4, 2))
    x = keys_like(T=8, D=32)
    quantize_rotated(keys_like(D=32), fmt, "keys", None, center)  # the centre set eagerly, as a cache's prefill does
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def step(x):
        return dispatch.quantize_keys(x, fmt, check=False, state=center)[:2]

    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(x)
    assert [t for t in targets if "hf_kvplus_cpu.rotated_encode" in str(t)], targets
    assert_same_codes(got, quantize_rotated(x, fmt, "keys", None, center))
    assert_same_codes(torch.compile(step, fullgraph=True)(x), got)


def test_bad_input_names_the_numbers():
    op = torch.ops.hf_kvplus_cpu.rotated_encode
    x = torch.randn(1, 2, 3, 32)
    centroids, boundaries = codebook(32, 4)
    r = rotation(32, 0)
    with pytest.raises(RuntimeError, match=r"float32 \[B, H, T, D\].*Double"):
        op(x.double(), r, boundaries, centroids, None, 4, True)
    with pytest.raises(RuntimeError, match="multiple of 8, got 12"):
        op(torch.randn(1, 2, 3, 12), None, boundaries, centroids, None, 4, True)
    with pytest.raises(RuntimeError, match="bits must be 1, 2, 3, 4 or 8, got 5"):
        op(x, r, boundaries, centroids, None, 5, True)
    with pytest.raises(RuntimeError, match="3-bit codes need 7 boundaries and 8 centroids.*15 and 16"):
        op(x, r, boundaries, centroids, None, 3, True)
    with pytest.raises(RuntimeError, match=r"rotation must be float32 \[32, 32\], got \[16, 16\]"):
        op(x, rotation(16, 0), boundaries, centroids, None, 4, True)
    with pytest.raises(RuntimeError, match=r"centre must be float32 \[2, 32\] or \[2, 3, 32\], got \[3, 32\]"):
        op(x, r, boundaries, centroids, torch.zeros(3, 32), 4, True)
    with pytest.raises(RuntimeError, match=r"or \[2, 3, 32\], got \[2, 4, 32\]"):  # a centre per token: T of them
        op(x, r, boundaries, centroids, torch.zeros(2, 4, 32), 4, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("centre", [False, True])
def test_coding_into_slots_equals_guard_then_operator(bits, centre, dtype):
    # What an evicting cache's rotated slots code a decode token with: at given rows or a span, the vectors RangeGuard
    # zeroes (a NaN, an inf, a length past the limit) coded as zero vectors and counted, every other bit the encode
    # operator's followed by the copies into the slots.
    from hf_kvplus.storage.value_range import RangeGuard

    fmt = RotatedFormat(bits, bits, seed=2)
    center = KeyCenter() if centre else None
    if center is not None:
        quantize_rotated(keys_like(D=32), fmt, "keys", None, center)  # set, as a cache's prompt sets it
    B, H, T, N, D = 2, 3, 8, 12, 32
    x = keys_like(B, H, T, D, seed=bits).to(dtype)
    x[0, 1, 1, 5], x[1, 2, 0, 7] = float("nan"), float("inf")
    x[1, 0, 1] = 3e4  # a length of 1.7e5, each element within the limit
    assert dispatch.takes_values_into(x, fmt, center)
    guard = RangeGuard(*fmt.code_limit())
    want = rotated_cpu.rotated_encode_cpu(guard(x), fmt, "values", None, center)
    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T)
    for rows in (slots, None):
        out = tuple(torch.full((B, H, N, w), 7, dtype=t) for w, t in ((D * bits // 8, torch.uint8), (1, torch.float16)))
        counted = torch.zeros((), dtype=torch.long)
        dispatch.quantize_values_into(x, fmt, (*out, None), 3, rows, limit=guard.limit, bad=counted, state=center)
        at = (slots if rows is not None else torch.arange(3, 3 + T).expand(B, H, T))[..., None]
        for got, ref in zip(out, want, strict=True):
            assert torch.equal(got.gather(2, at.expand(*at.shape[:3], ref.shape[-1])), ref), f"{fmt} {dtype}"
            untouched = torch.ones(B, H, N, dtype=torch.bool).scatter(2, at[..., 0], False)
            assert (got[untouched] == 7).all()
        assert int(counted) == int(guard.pending) == 3
    unguarded = tuple(torch.zeros_like(t) for t in want)
    dispatch.quantize_values_into(x[:, :, :1].float().nan_to_num(0, 0, 0), fmt, (*unguarded, None), 0, state=center)
    assert torch.equal(unguarded[0][:, :, :1], rotated_cpu.rotated_encode_cpu(
        x[:, :, :1].float().nan_to_num(0, 0, 0), fmt, "values", None, center)[0])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k_bits", "v_bits"), [(4, 2), (3, 2), (2, 4), (8, 8)])
@pytest.mark.parametrize(("T", "Dk", "Dv"), [(1, 32, 32), (3, 64, 32)])
def test_key_and_value_in_one_call_equal_one_call_per_side(k_bits, v_bits, T, Dk, Dv, dtype, monkeypatch):
    # An evicting cache's decode token: its key (centred) and value coded into their slots by one operator call, each
    # side the bits of one `quantize_values_into` call of its own format (keys at the key bits on both sides), the
    # vectors the guard zeroes on either side counted once each.
    from hf_kvplus.storage.value_range import RangeGuard

    k_fmt, v_fmt = RotatedFormat(k_bits, k_bits, seed=5), RotatedFormat(v_bits, v_bits, seed=5)
    center = KeyCenter()
    quantize_rotated(keys_like(D=Dk), k_fmt, "keys", None, center)  # set, as a cache's prompt sets it
    B, H, N = 2, 3, 7
    k = keys_like(B, H, 8, Dk, seed=k_bits)[:, :, 8 - T :].to(dtype)  # (the zero vector among them at T = 3)
    v = keys_like(B, H, 8, Dv, seed=v_bits + 9)[:, :, :T].to(dtype)
    k[0, 1, 0, 5], v[1, 2, T - 1, 7] = float("nan"), float("inf")
    guard = RangeGuard(*k_fmt.code_limit())
    calls = []
    real = rotated_cpu.rotated_encode_kv_into_cpu
    monkeypatch.setattr(rotated_cpu, "rotated_encode_kv_into_cpu", lambda *a: calls.append(1) or real(*a))

    def buffers(D, bits):
        return tuple(torch.full((B, H, N, w), 7, dtype=t) for w, t in ((D * bits // 8, torch.uint8), (1, torch.float16)))

    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T)
    for rows in (slots, None):
        got_k, got_v, counted = buffers(Dk, k_bits), buffers(Dv, v_bits), torch.zeros((), dtype=torch.long)
        dispatch.quantize_kv_into(k, v, (k_fmt, v_fmt), (*got_k, None), (*got_v, None), 2, rows, limit=guard.limit,
                                  bad=counted, state=center)  # fmt: skip
        want_k, want_v, separate = buffers(Dk, k_bits), buffers(Dv, v_bits), torch.zeros((), dtype=torch.long)
        dispatch.quantize_values_into(k, k_fmt, (*want_k, None), 2, rows, limit=guard.limit, bad=separate,
                                      state=center)  # fmt: skip
        dispatch.quantize_values_into(v, v_fmt, (*want_v, None), 2, rows, limit=guard.limit, bad=separate)
        for got, want in zip((*got_k, *got_v), (*want_k, *want_v), strict=True):
            assert torch.equal(got, want), f"{k_fmt}/{v_fmt} {dtype}"
        assert int(counted) == int(separate) == 2
    assert len(calls) == 2  # one call per coding, both sides


def test_coding_into_slots_is_refused_where_it_cannot_run_and_names_bad_rows():
    fmt = RotatedFormat(4, 2, seed=0)
    x = torch.randn(2, 3, 1, 32)
    assert dispatch.takes_values_into(x, fmt, None)
    assert not dispatch.takes_values_into(x, fmt, KeyCenter())  # unset: set from keys the guard has not cleaned
    assert not dispatch.takes_values_into(x.to("meta"), fmt, None)
    codes, norms = torch.zeros(2, 3, 4, 8, dtype=torch.uint8), torch.zeros(2, 3, 4, 1, dtype=torch.float16)
    out = (codes, norms, None)  # 2-bit values: 8 bytes a vector
    with pytest.raises(RuntimeError, match="rows 4..4 of 4"):
        dispatch.quantize_values_into(x, fmt, out, 4)
    with pytest.raises(RuntimeError, match="slot 9 outside 0..3"):
        dispatch.quantize_values_into(x, fmt, out, 0, torch.full((2, 3, 1), 9))
    with pytest.raises(RuntimeError, match=r"norms must be float16 \[2, 3, 4, 1\], got Float"):
        dispatch.quantize_values_into(x, fmt, (out[0], out[1].float(), None), 0)
    with pytest.raises(RuntimeError, match=r"uint8 \[2, 3, N, 8\] with unit last stride, got Byte \[2, 3, 4, 16\]"):
        dispatch.quantize_values_into(x, fmt, (torch.zeros(2, 3, 4, 16, dtype=torch.uint8), norms, None), 0)


def test_the_operators_tables_go_with_a_cleared_codebook(monkeypatch):
    # The operators read a format's rotation, codebook and byte tables through one lookup a call (derived tables); an
    # evaluation that swaps a codebook clears its table, and the next call must code with the new one.
    from hf_kvplus.kernels import rotated_format

    fmt = RotatedFormat(4, 4, seed=1)
    x = torch.randn(1, 2, 1, 32, generator=torch.Generator().manual_seed(0))

    def coded() -> torch.Tensor:
        out = (torch.zeros(1, 2, 1, 16, dtype=torch.uint8), torch.zeros(1, 2, 1, 1, dtype=torch.float16), None)
        dispatch.quantize_values_into(x, fmt, out, 0)
        return out[0]

    before = coded()
    assert rotated_cpu._CODERS._kept
    wide = [2 * c for c in rotated_format._centroids(32, 4)]  # boundaries twice as far out: other codes
    monkeypatch.setattr(rotated_format, "_centroids", lambda head_dim, bits: wide)
    rotated_format._CODEBOOKS.clear()
    assert not rotated_cpu._CODERS._kept and not rotated_cpu._DECODERS._kept
    try:
        assert torch.equal(coded(), rotated_cpu.rotated_encode_cpu(x, fmt, "values")[0])
        assert not torch.equal(coded(), before)
    finally:
        monkeypatch.undo()
        rotated_format._CODEBOOKS.clear()
    assert torch.equal(coded(), before)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
@pytest.mark.skipif(os.environ.get("HF_KVPLUS_CPU_KERNELS") == "0", reason="HF_KVPLUS_CPU_KERNELS=0 turns them off")
def test_the_cpu_operators_build_where_there_is_a_compiler():
    """The operators' tests skip where they cannot be built (no toolchain): with a compiler here, a compile error in
    kernels/*.cpp must fail, not skip them all."""
    assert rotated_cpu.available()
