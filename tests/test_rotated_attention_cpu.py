"""The rotated formats' C++ decode attention on the CPU (``kernels/rotated_cpu``).

The operator is checked against the float64 softmax over the twin's decoded keys and values (codes of every bit
width, centred keys with both signs of norm, keys relative to a turning centre, a ring, a mask, an offset window, query groups, the mass), with the
codes outside the window and the norms of masked tokens poisoned (0xFF, NaN); then that the dispatcher sends CPU
calls to it, eager and compiled (one node of the graph), that bad input gets an error naming the numbers, and
that without it (no toolchain, or ``HF_KVPLUS_CPU_KERNELS=0``) the twin runs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from hf_kvplus.kernels import rotated_cpu
from hf_kvplus.kernels.dispatch import quantized_decode_attention
from hf_kvplus.kernels.quant_format import PackedKV
from hf_kvplus.kernels.rotated_format import (
    KeyCenter,
    RotatedFormat,
    dequantize_rotated,
    quantize_rotated,
    rotation,
)
from hf_kvplus.kernels.turning_center import RotaryBasis

TOOLCHAIN = bool(shutil.which("c++") or shutil.which("g++")) and bool(
    shutil.which("ninja") or importlib.util.find_spec("ninja")
)
needs_operator = pytest.mark.skipif(not TOOLCHAIN, reason="no C++ compiler or ninja to build the CPU operator")


@pytest.fixture(autouse=True)
def built():
    """The operator built (or found built) before a test calls it, as `RotatedFormat.prepare` does for a cache."""
    if TOOLCHAIN:
        rotated_cpu.available()


def make_case(key_bits, value_bits, D, *, centred, B=2, Hkv=2, G=2, N=70, R=5, start=6, seed=0, origin=3):
    """Codes of N tokens (keys around a common offset with a far-off first token, so a centred format codes both
    signs of norm; `centred="turning"`: relative to a centre turning with RoPE, index 0 at `origin`), q and a ring
    of R as the model gives them, and a mask over the window ``start .. N`` plus the ring."""
    g = torch.Generator().manual_seed(seed)
    center = turning_center(D, origin) if centred == "turning" else KeyCenter() if centred else None
    fmt = RotatedFormat(key_bits, value_bits, seed=3)
    keys = torch.randn(B, Hkv, N, D, generator=g) + 2 * torch.randn(Hkv, 1, D, generator=g)
    keys[:, :, 0] = 6 * torch.randn(B, Hkv, D, generator=g)
    values = torch.randn(B, Hkv, N, D, generator=g)
    kc, kn = quantize_rotated(keys, fmt, "keys", torch.arange(N) if centred == "turning" else None, center)
    vc, vn = quantize_rotated(values, fmt, "values")
    q = torch.randn(B, Hkv * G, D, generator=g)
    ring_k, ring_v = torch.randn(B, Hkv, R, D, generator=g), torch.randn(B, Hkv, R, D, generator=g)
    mask = torch.rand(B, N - start + R, generator=g) > 0.3
    mask[0, -1] = True
    return fmt, center, PackedKV(kc, kn, None, vc, vn, None), q, ring_k, ring_v, mask, start


def turning_center(D: int, origin: int = 3) -> KeyCenter:
    """A key centre turning with a partial RoPE (the last quarter of the channels does not turn), index 0 at
    `origin`."""
    rotary = D - D // 4 // 2 * 2
    return KeyCenter(RotaryBasis(1.0 / 100.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary), D), origin)


def reference(fmt, center, packed, q, ring_k, ring_v, mask, start, scale):
    """float64 (output [B, Hq, D], mass [B, Hkv, L]) over the decoded window and the ring, in the rotated space
    (q and the ring rotated in, the output rotated back)."""
    r = rotation(q.shape[-1], fmt.seed).double()
    q, ring_k, ring_v = q.double() @ r, ring_k.double() @ r, ring_v.double() @ r
    turning = center is not None and center.turns is not None
    k = dequantize_rotated(packed.k[:, :, start:], packed.k_scale[:, :, start:], fmt, "keys", rotated_space=True,
                           positions=torch.arange(start, packed.k.shape[2]) if turning else None,
                           center=center)  # fmt: skip
    v = dequantize_rotated(packed.v[:, :, start:], packed.v_scale[:, :, start:], fmt, "values", rotated_space=True)
    k, v = torch.cat([k, ring_k], 2).double(), torch.cat([v, ring_v], 2).double()
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.double().view(B, Hkv, Hq // Hkv, D)
    s = (qg @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.nan_to_num(s.softmax(-1))
    return (p @ v).view(B, Hq, -1) @ r.T, p.sum(2)


def poison(packed, mask, start):
    """Codes before the window 0xFF with NaN norms, and NaN norms at masked tokens: a read of either shows."""
    kc, kn, vc, vn = (t.clone() for t in (packed.k, packed.k_scale, packed.v, packed.v_scale))
    kc[:, :, :start], vc[:, :, :start] = 0xFF, 0xFF
    kn[:, :, :start], vn[:, :, :start] = float("nan"), float("nan")
    N = kc.shape[2]
    masked = ~mask[:, : N - start]
    for t in (kn, vn):
        t[:, :, start:][masked[:, None, :, None].expand(-1, t.shape[1], -1, 1)] = float("nan")
    return PackedKV(kc, kn, None, vc, vn, None)


@needs_operator
def test_the_operator_builds_where_there_is_a_toolchain():
    assert rotated_cpu.available()


@needs_operator
@pytest.mark.parametrize(
    "key_bits,value_bits,D,centred",
    [(4, 2, 32, True), (3, 2, 32, True), (4, 4, 64, False), (2, 3, 64, True), (8, 1, 32, False), (1, 8, 40, True),
     (3, 3, 48, False), (4, 2, 64, "turning"), (3, 2, 32, "turning"), (8, 4, 48, "turning")],
)  # fmt: skip
@pytest.mark.parametrize("G,ring_rotated", [(1, False), (3, True), (6, False)])
@pytest.mark.parametrize("N", [70, 1100])  # keys decoded; keys through per-query tables (`kTableWork`)
def test_the_operator_matches_float64_attention_over_the_decoded_codes(key_bits, value_bits, D, centred, G,
                                                                        ring_rotated, N):  # fmt: skip
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(key_bits, value_bits, D, centred=centred, G=G, N=N)
    want_out, want_mass = reference(fmt, center, packed, q, ring_k, ring_v, mask, start, 0.3)
    if ring_rotated:  # as a static storage holds it
        fmt, r = fmt.with_rotated_inputs(), rotation(D, fmt.seed)
        ring_k, ring_v = ring_k @ r, ring_v @ r
    out, mass = rotated_cpu.rotated_decode_cpu(
        q, poison(packed, mask, start), fmt, start, N - start, 0.3, ring_k, ring_v, mask, True, center
    )
    assert out.dtype == torch.float32 and out.shape == want_out.shape
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass.double(), want_mass, atol=2e-6, rtol=1e-4)
    alone, none = rotated_cpu.rotated_decode_cpu(q, packed, fmt, start, N - start, 0.3, ring_k, ring_v,
                                                           mask, False, center)  # fmt: skip
    assert none is None
    torch.testing.assert_close(alone, out, atol=0, rtol=0)


@needs_operator
@pytest.mark.parametrize("centred", [True, "turning"])
def test_the_operator_reads_only_its_range_of_a_buffer_that_holds_more(centred):
    """A growing segment's buffer holds room past its tokens: the operator reads codes start .. start + length in
    place, so codes past them (poisoned: 0xFF codes, NaN norms) change nothing."""
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(4, 2, 32, centred=centred, G=2)
    want_out, want_mass = reference(fmt, center, packed, q, ring_k, ring_v, mask, start, 0.3)
    N, extra = packed.k.shape[2], 9
    packed = poison(packed, mask, start)

    def roomy(t, fill):
        return torch.cat([t, torch.full((*t.shape[:2], extra, t.shape[3]), fill, dtype=t.dtype)], dim=2)

    held = PackedKV(roomy(packed.k, 0xFF), roomy(packed.k_scale, float("nan")), None, roomy(packed.v, 0xFF),
                    roomy(packed.v_scale, float("nan")), None)  # fmt: skip
    out, mass = rotated_cpu.rotated_decode_cpu(q, held, fmt, start, N - start, 0.3, ring_k, ring_v, mask, True, center)
    assert mass.shape == want_mass.shape
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass.double(), want_mass, atol=2e-6, rtol=1e-4)


@needs_operator
@pytest.mark.parametrize(
    "G,N,start,origin",
    [(5, 300, 6, 3), (3, 300, 0, 40_000), (1, 300, 61, 7), (2, 300, 6, 3), (4, 131, 2, 3), (8, 200, 0, 5),
     (5, 50, 3, 3), (10, 200, 0, 3)],
)  # fmt: skip
def test_a_turning_centre_over_many_blocks_of_positions(G, N, start, origin):
    """The operator sums a turning centre's term over blocks of positions, each block's from the first block's
    basis turned by its offset (angle addition, in float32), six rows (query, block) at a time: over several
    blocks and a ragged last one, row counts that leave 0 to 5 rows to a last tile (G = 1 .. 8), a window starting
    inside a block, positions far from 0, and a window under one block (whose keys are decoded, not tabled); G = 10
    also takes the key tables' queries in two vectors (8, then 2)."""
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(4, 2, 64, centred="turning", G=G, N=N, start=start,
                                                            origin=origin)  # fmt: skip
    want_out, want_mass = reference(fmt, center, packed, q, ring_k, ring_v, mask, start, 0.3)
    out, mass = rotated_cpu.rotated_decode_cpu(q, poison(packed, mask, start), fmt, start, N - start, 0.3, ring_k,
                                               ring_v, mask, True, center)  # fmt: skip
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass.double(), want_mass, atol=2e-6, rtol=1e-4)


@needs_operator
@pytest.mark.parametrize("key_bits,value_bits,centred", [(4, 2, True), (3, 4, True), (1, 2, True), (2, 2, "turning")])
def test_a_short_window_decodes_its_keys_in_place(key_bits, value_bits, centred):
    """Under the tables' work (`kTableWork`: positions times queries + 1) the keys' scores come from decoded codes, not
    from per-query tables."""
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(key_bits, value_bits, 32, centred=centred, N=40, G=2)
    want_out, want_mass = reference(fmt, center, packed, q, ring_k, ring_v, mask, start, 0.3)
    out, mass = rotated_cpu.rotated_decode_cpu(q, poison(packed, mask, start), fmt, start, 40 - start, 0.3,
                                                         ring_k, ring_v, mask, True, center)  # fmt: skip
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass.double(), want_mass, atol=2e-6, rtol=1e-4)


@needs_operator
def test_without_a_ring_or_a_mask_and_with_every_key_masked():
    fmt, center, packed, q, _, _, _, _ = make_case(4, 2, 32, centred=True)
    N = packed.k.shape[2]
    full = torch.ones(q.shape[0], N, dtype=torch.bool)
    want_out, want_mass = reference(fmt, center, packed, q, q.new_zeros(2, 2, 0, 32), q.new_zeros(2, 2, 0, 32), full, 0, 0.2)
    out, mass = rotated_cpu.rotated_decode_cpu(q, packed, fmt, 0, N, 0.2, None, None, None, True, center)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass.double(), want_mass, atol=2e-6, rtol=1e-4)
    none = torch.zeros_like(full)
    none[1] = True
    out, mass = rotated_cpu.rotated_decode_cpu(q, packed, fmt, 0, N, 0.2, None, None, none, True, center)
    assert out[0].eq(0).all() and mass[0].eq(0).all()  # a row with no key attended: zeros, no NaN
    torch.testing.assert_close(out[1].double(), want_out[1], atol=2e-5, rtol=1e-4)


@needs_operator
@pytest.mark.parametrize("with_mass", [False, True])
def test_the_dispatcher_sends_cpu_calls_to_the_operator_and_agrees_with_the_twin(monkeypatch, with_mass):
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(3, 2, 32, centred=True)
    kernel = quantized_decode_attention
    kw = dict(start=start, length=packed.k.shape[2] - start, scale=0.3, residual_k=ring_k, residual_v=ring_v, mask=mask,
              with_mass=with_mass, state=center)  # fmt: skip
    calls = []
    real = rotated_cpu.rotated_decode_cpu
    monkeypatch.setattr(rotated_cpu, "rotated_decode_cpu", lambda *a: calls.append(a) or real(*a))
    got = kernel(q, packed, fmt, **kw)
    assert len(calls) == 1
    monkeypatch.setattr(rotated_cpu, "_LOADED", False)  # as where it cannot be built: the twin
    want = kernel(q, packed, fmt, **kw)
    assert len(calls) == 1
    for a, b in zip(got if with_mass else [got], want if with_mass else [want], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@needs_operator
def test_a_compiled_call_is_one_node_of_the_graph():
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(4, 2, 32, centred=True)
    length = packed.k.shape[2] - start
    fmt, r = fmt.with_rotated_inputs(), rotation(32, fmt.seed)  # a static storage's ring: rotated already
    ring_k, ring_v = ring_k @ r, ring_v @ r

    def step(q, ring_k, ring_v, mask):
        return quantized_decode_attention(q, packed, fmt, start=start, length=length, scale=0.3, residual_k=ring_k,
                                          residual_v=ring_v, mask=mask, check=False, state=center)  # fmt: skip

    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    assert rotated_cpu.available()  # built before tracing, as `RotatedFormat.prepare` does
    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(q, ring_k, ring_v, mask)
    assert [t for t in targets if "hf_kvplus_cpu.rotated_decode" in str(t)], targets
    torch.testing.assert_close(got, step(q, ring_k, ring_v, mask), atol=0, rtol=0)
    inductor = torch.compile(step, fullgraph=True)(q, ring_k, ring_v, mask)
    torch.testing.assert_close(inductor, got, atol=1e-5, rtol=1e-5)


@needs_operator
def test_bad_input_names_the_numbers():
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(4, 2, 32, centred=False)
    N = packed.k.shape[2]
    with pytest.raises(RuntimeError, match="hold 32 channels and q 40"):
        rotated_cpu.rotated_decode_cpu(torch.randn(2, 4, 40), packed, fmt, 0, N, 0.3, None, None, None, False, center)
    with pytest.raises(RuntimeError, match=r"mask must be bool \[B, 75\]"):
        rotated_cpu.rotated_decode_cpu(q, packed, fmt, 0, N, 0.3, ring_k, ring_v, mask, False, center)
    with pytest.raises(RuntimeError, match="4 query heads on 3 KV heads"):
        three = PackedKV(*(t[:, :1].expand(-1, 3, -1, -1) for t in (packed.k, packed.k_scale)), None,
                         *(t[:, :1].expand(-1, 3, -1, -1) for t in (packed.v, packed.v_scale)), None)  # fmt: skip
        rotated_cpu.rotated_decode_cpu(q, three, fmt, 0, N, 0.3, None, None, None, False, center)


def test_a_failed_build_warns_once_and_leaves_the_twin(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(rotated_cpu, "_SOURCES", [broken])
    # A flag the compiler refuses fails the build at once (the source alone fails only after the ~30 s of
    # torch/extension.h that load_inline puts before it)
    monkeypatch.setattr(rotated_cpu, "_FLAGS", [*rotated_cpu._FLAGS, "-fkvplus-no-such-option"])
    monkeypatch.setattr(rotated_cpu, "_LOADED", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert not rotated_cpu.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not rotated_cpu.available()  # tried once
    fmt, center, packed, q, ring_k, ring_v, mask, start = make_case(4, 2, 32, centred=True)
    out = quantized_decode_attention(q, packed, fmt, start=start, length=packed.k.shape[2] - start, scale=0.3,
                                     residual_k=ring_k, residual_v=ring_v, mask=mask, state=center)  # fmt: skip
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_the_switch_turns_the_operator_off():
    env = {**os.environ, "HF_KVPLUS_CPU_KERNELS": "0"}
    code = "from hf_kvplus.kernels import rotated_cpu as m; print(m.available())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
