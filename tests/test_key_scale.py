"""A rotated format's key scale (`KeyCenter.scale`, `key_scale.KeyScale`): keys coded as ``k * s``, attention reading
``q / s``, dense reads giving ``k^ / s``.

Attention with a scale is compared with float64 attention over the dequantized keys (which leave the cache divided
back) on the C++ operator, the twin and the compiled twin, with a residual held as it came and one held rotated (a
static storage's ring); a scale of 1 gives the codes and outputs of no scale bit for bit; a round trip comes back
within the format's error, and the scaled codes are those of the scaled keys. Bad scales are refused naming the
numbers. The shipped Gemma 3 270M scale is found for that model and no other, and the argument or the spec turns it
off; a cache with it on reproduces the model whose QK-norm the scale is folded into (the probe that measured it).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import reference

from hf_kvplus import OffloadedCache, QuantizedCache, cache_kwargs, fitted
from hf_kvplus.errors import CacheMismatchError, ConfigError, ShapeError
from hf_kvplus.kernels import rotated_cpu, rotated_kernels
from hf_kvplus.kernels.dispatch import quantized_decode_attention
from hf_kvplus.kernels.quant_format import PackedKV
from hf_kvplus.kernels.rotated_format import (
    KeyCenter,
    RotatedFormat,
    checked_key_scale,
    dequantize_rotated,
    quantize_rotated,
)
from hf_kvplus.kernels.rotated_pack import quantize_rotated_triton
from hf_kvplus.key_scale import KeyScale
from hf_kvplus.planning.configs import load_config
from hf_kvplus.specs import parse_cache_spec

GEMMA3 = "gemma3_text-l18-kv1-d256-h640-v262144"


@pytest.fixture(autouse=True)
def cpu_tensors(device, request):
    """The paths compared here are the CPU's (the C++ operator, the twins, Triton interpreted), drawn from CPU
    generators: CPU tensors whatever device the suite runs on (on CUDA, tests/test_rotated_kernels.py runs the Triton
    kernels). On the CPU suite no device mode is entered: `torch.compile` traces the twin without one."""
    if device.type != "cpu":
        request.getfixturevalue("on_cpu")


def pair_scale(H: int, D: int, generator: torch.Generator) -> torch.Tensor:
    """A scale [H, D] from 0.2 to 5, equal on each RoPE pair."""
    s = torch.exp(torch.empty(H, D // 2).uniform_(-1.6, 1.6, generator=generator))
    return torch.cat([s, s], dim=-1)


def keys_and_queries(B, Hkv, G, T, D, generator):
    """Keys whose pairs differ in length by up to 10x (what a scale is for) around an offset per head, and queries."""
    lengths = torch.cat([torch.logspace(0, 1, D // 2)] * 2)
    k = torch.randn(B, Hkv, T, D, generator=generator) * lengths + 3 * torch.randn(1, Hkv, 1, D, generator=generator)
    return k, torch.randn(B, Hkv * G, D, generator=generator)


@pytest.mark.parametrize("path", ["cpu-operator", "twin", "compiled", "triton"])
@pytest.mark.parametrize("ring", ["as-it-came", "rotated"])
def test_attention_with_a_scale_is_attention_over_the_keys_divided_back(path, ring, monkeypatch, device):
    if path in ("triton", "compiled") and device.type != "cpu":
        pytest.skip("a CPU path of the CPU suite: Triton on CPU tensors needs the interpreter it turns on, and Dynamo "
                    "does not trace the twin under the device mode that keeps these tensors on the CPU")
    if path != "cpu-operator":
        monkeypatch.setattr(rotated_cpu, "_LOADED", False)
    elif not rotated_cpu.available():
        pytest.skip("the C++ operators do not build here")
    if path == "triton":  # the Triton kernels, interpreted on the CPU where no GPU is (conftest's TRITON_INTERPRET)
        monkeypatch.setattr(rotated_kernels, "path_of", lambda *_args: "triton")
    g = torch.Generator().manual_seed(11)
    B, Hkv, G, T, R, D = 2, 2, 2, 40, 6, 64
    fmt = RotatedFormat(3, 2, 5)
    center = fmt.make_state(key_scale=pair_scale(Hkv, D, g))
    k, q = keys_and_queries(B, Hkv, G, T + R, D, g)
    v = torch.randn(B, Hkv, T + R, D, generator=g)
    kc, kn = quantize_rotated(k[:, :, :T], fmt, "keys", center=center)
    if path == "triton":  # its encoder codes the scaled keys as the twin does
        tc, tn, _ = quantize_rotated_triton(k[:, :, :T], fmt, "keys", center=center)
        assert torch.equal(tc, kc) and torch.allclose(tn.float(), kn.float(), rtol=1e-3)
    vc, vn = quantize_rotated(v[:, :, :T], fmt, "values")
    packed = PackedKV(kc, kn, None, vc, vn, None)
    k_hat = dequantize_rotated(kc, kn, fmt, "keys", torch.float64, center=center)  # divided back
    v_hat = dequantize_rotated(vc, vn, fmt, "values", torch.float64)
    rk, rv = k[:, :, T:], v[:, :, T:]
    read_fmt = fmt
    if ring == "rotated":  # a static storage's ring: keys scaled and rotated as they go in
        rk, rv = fmt.to_ring(rk, rv, lambda: T, center)
        back_k, back_v = fmt.from_ring(rk, rv, center)
        torch.testing.assert_close(back_k, k[:, :, T:], atol=1e-4, rtol=1e-5)  # the ring gives back the keys
        read_fmt = fmt.with_rotated_inputs()
    scale = 1 / math.sqrt(D)

    def attend(q, rk, rv):
        return quantized_decode_attention(q, packed, read_fmt, start=0, length=T, scale=scale, residual_k=rk,
                                          residual_v=rv, check=path != "compiled", state=center)  # fmt: skip

    if path == "compiled":
        torch._dynamo.reset()
        # aot_eager: the compiled branches of the twin, traced and functionalized as inductor takes them, without
        # inductor's C++ code generation on the CPU (20-60 s a case)
        attend = torch.compile(attend, fullgraph=True, backend="aot_eager")
    out = attend(q, rk, rv)
    want = reference(q, torch.cat([k_hat, k[:, :, T:].double()], 2), torch.cat([v_hat, v[:, :, T:].double()], 2), scale)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    # the same codes read without the scale are other keys: the query's division is what makes them right
    plain = KeyCenter(scale=None)
    plain.mu, plain.rotated, plain.in_planes = center.mu, center.rotated, center.in_planes
    unscaled = quantized_decode_attention(q, packed, fmt, start=0, length=T, scale=scale, state=plain)
    assert not torch.allclose(unscaled.double(), reference(q, k_hat, v_hat, scale), atol=1e-2)


def test_a_scale_of_one_codes_and_attends_bit_for_bit_as_no_scale():
    g = torch.Generator().manual_seed(3)
    B, Hkv, G, T, D = 1, 2, 2, 33, 64
    fmt = RotatedFormat(4, 2, 1)
    k, q = keys_and_queries(B, Hkv, G, T, D, g)
    v = torch.randn(B, Hkv, T, D, generator=g)
    results = []
    for center in (fmt.make_state(), fmt.make_state(key_scale=torch.ones(Hkv, D))):
        kc, kn = quantize_rotated(k, fmt, "keys", center=center)
        vc, vn = quantize_rotated(v, fmt, "values")
        out = quantized_decode_attention(q, PackedKV(kc, kn, None, vc, vn, None), fmt, start=0, length=T - 5,
                                         scale=0.125, residual_k=k[:, :, -5:], residual_v=v[:, :, -5:], state=center)
        results.append((kc, kn, out, dequantize_rotated(kc, kn, fmt, "keys", center=center)))
    assert fmt.make_state().scale is None  # no scale given: none held, and no branch taken on one
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_scaled_codes_are_the_codes_of_the_scaled_keys_and_come_back_divided():
    g = torch.Generator().manual_seed(5)
    fmt = RotatedFormat(4, 2, 2)
    s = pair_scale(2, 64, g)
    k, _ = keys_and_queries(1, 2, 1, 50, 64, g)
    scaled = fmt.make_state(key_scale=s)
    kc, kn = quantize_rotated(k, fmt, "keys", center=scaled)
    by_hand = fmt.make_state()
    hc, hn = quantize_rotated(k * s[:, None, :], fmt, "keys", center=by_hand)
    assert torch.equal(kc, hc) and torch.equal(kn, hn)
    torch.testing.assert_close(scaled.mu, by_hand.mu)
    back = dequantize_rotated(kc, kn, fmt, "keys", center=scaled)
    by_hand_back = dequantize_rotated(hc, hn, fmt, "keys", center=by_hand) / s[:, None, :]
    torch.testing.assert_close(back, by_hand_back)
    ks = k * s[:, None, :]  # within the format's error where the codes were made (4 bits: about a tenth)
    assert float(((back * s[:, None, :]) - ks).norm() / ks.norm()) < 0.15


@pytest.mark.parametrize("bad, error, words", [
    (torch.ones(64), ShapeError, "[KV heads, head_dim]"),
    (torch.ones(2, 63), ShapeError, "(2, 63)"),
    ([1.0, 2.0], ShapeError, "list"),
    (torch.ones(2, 64).index_fill(1, torch.tensor([3, 35]), 0.0), ConfigError, "4 of its 128 numbers are not"),
    (torch.ones(2, 64).index_fill(1, torch.tensor([5, 37]), -2.0), ConfigError, "channel 5: -2.0"),
    (torch.ones(2, 64).index_fill(1, torch.tensor([7, 39]), float("nan")), ConfigError, "head 0, channel 7: nan"),
    (torch.ones(2, 64).index_fill(1, torch.tensor([1, 33]), float("inf")), ConfigError, "channel 1: inf"),
    (torch.ones(2, 64).index_fill(1, torch.tensor([9]), 2.0), ConfigError, "2.0 on channel 9 and 1.0 on 41"),
])  # fmt: skip
def test_a_bad_scale_is_refused_naming_the_numbers(bad, error, words):
    with pytest.raises(error, match=None) as raised:
        checked_key_scale(bad)
    assert words in str(raised.value)
    with pytest.raises(error):
        RotatedFormat(4, 2).make_state(key_scale=bad)


def test_a_key_scale_file_round_trips_and_refuses_another_model(tmp_path):
    gemma, smollm = load_config("gemma3-270m"), load_config("smollm2-135m")
    scale = fitted.key_scale_for(gemma)
    assert scale is not None and scale.model_type == "gemma3_text" and sorted(scale.scales) == list(range(18))
    again = KeyScale.load(scale.save(tmp_path / "k.safetensors"))
    assert all(torch.equal(again.scales[i], scale.scales[i]) for i in scale.scales)
    with pytest.raises(CacheMismatchError, match="18 layers"):
        again.check(smollm)
    with pytest.raises(ConfigError, match="layer 3: .*channel 2"):
        KeyScale("m", "gemma3_text", 18, {3: torch.ones(1, 256).index_fill(1, torch.tensor([2]), 3.0)})
    with pytest.raises(ConfigError, match="names layer 20"):
        KeyScale("m", "gemma3_text", 18, {20: torch.ones(1, 256)})
    with pytest.raises(ConfigError, match="no key scale file"):
        KeyScale.load(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("name", ["gemma3-270m", "gemma3-4b", "smollm2-135m"])
def test_the_shipped_scale_is_taken_by_gemma3s_rotated_caches_and_no_others(name, monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path))  # an empty user folder: the package data alone
    config = load_config(name)
    gemma = name == "gemma3-270m"
    for build in (lambda: QuantizedCache(config, bits="k4v2"), lambda: parse_cache_spec("quantized:k3v2").build(config),
                  lambda: OffloadedCache(config, bits="k2v2"),
                  lambda: parse_cache_spec("offloaded-quantized:k4v2").build(config)):  # fmt: skip
        cache = build()
        held = [layer.storage.states()[0].scale for layer in cache.layers]
        if not isinstance(cache, OffloadedCache):
            assert (cache.quantized_report()["key_scale"] == "gemma3-270m") == gemma
        assert all((s is not None) == gemma for s in held)
    for off in (lambda: QuantizedCache(config, bits="k4v2", key_scale="off"),
                lambda: QuantizedCache(config, bits="k4v2", key_scale=None),
                lambda: parse_cache_spec("quantized:k4v2:key_scale=off").build(config),
                lambda: OffloadedCache(config, bits="k4v2", key_scale="off"),
                lambda: parse_cache_spec("offloaded-quantized:k3v2:key_scale=off").build(config),
                lambda: QuantizedCache(config, bits=4)):  # fmt: skip
        cache = off()
        assert isinstance(cache, OffloadedCache) or cache.quantized_report()["key_scale"] is None
        assert all(getattr(layer.storage.states()[0], "scale", None) is None for layer in cache.layers)


def test_a_cache_with_the_scale_is_the_model_with_it_folded_into_its_qk_norm():
    # The probe that measured the scale folded it into Gemma 3's QK-norm weights (the model the same, the cache's keys
    # scaled): the cache holding it gives that model's logits, to float precision, and no scale gives others.
    from hf_kvplus.resolve import load_model

    model, _ = load_model("gemma3-270m")
    scale = fitted.key_scale_for(model.config)
    ids = torch.randint(10, 20000, (1, 96), generator=torch.Generator().manual_seed(0))

    def logits(key_scale, fold):
        cache = QuantizedCache(model.config, bits="k2v2", window=16, family_defaults=False, key_scale=key_scale)
        kept = []
        with torch.no_grad():
            for index, s in (scale.scales.items() if fold else ()):
                attention = model.model.layers[index].self_attn
                for weight, factor in ((attention.q_norm.weight, 1 / s[0]), (attention.k_norm.weight, s[0])):
                    kept.append((weight, weight.clone()))
                    weight.copy_((1 + weight.double()) * factor.double() - 1)
            try:
                out = [model(input_ids=ids[:, i : i + 32], **cache_kwargs(cache), use_cache=True).logits
                       for i in range(0, 96, 32)]  # fmt: skip
            finally:
                for weight, original in kept:
                    weight.copy_(original)
        return torch.cat(out, 1)

    built, folded, plain = logits("auto", False), logits("off", True), logits("off", False)
    assert float((built - folded).abs().max()) < 2e-3  # measured 1.4e-4; the scale moves them by 21
    assert float((built - plain).abs().max()) > 0.1


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_a_scaled_cache_fitted_on_a_model_saves_loads_and_decodes_as_it_did(static, tmp_path):
    # The tiny Gemma 3 (QK-norm, sliding and full layers): a scale fitted on it by the package's fit, a k3v2 cache
    # holding it (a static storage's ring too) decodes as the scale-free cache does not, its dense keys are the keys
    # that came in to the format's error, and a saved copy continues with the same logits.
    from conformance.models import get_model
    from hf_kvplus import load_cache
    from hf_kvplus.evaluation.key_scale_fit import fit_key_scale

    model = get_model("gemma3")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    fitted_here = fit_key_scale(model, ids[0], "tiny gemma3")
    assert set(fitted_here.scales) == set(range(model.config.num_hidden_layers))
    # (the tiny model's fitted scales are all near 1: a wide one of the same shape shows a missing division)
    g = torch.Generator().manual_seed(4)
    scale = KeyScale("tiny gemma3", fitted_here.model_type, fitted_here.num_layers,
                     {i: pair_scale(*s.shape, g) for i, s in fitted_here.scales.items()})  # fmt: skip
    kw = dict(bits="k3v2", window=8, family_defaults=False, max_tokens=64 if static else None)
    caches = [QuantizedCache(model.config, key_scale=s, **kw) for s in (scale, "off")]
    token = torch.tensor([[7]])
    with torch.no_grad():
        logits = [(model(input_ids=ids, **cache_kwargs(c)), model(input_ids=token, **cache_kwargs(c)).logits)[1]
                  for c in caches]  # fmt: skip
    assert not torch.equal(logits[0], logits[1])  # (a prompt attends to its own keys exact: a decode step reads codes)
    keys = caches[0].layers[2].storage.view(41)[0]  # a full layer's keys, read back divided
    exact = QuantizedCache(model.config, bits="k8v8", window=8, family_defaults=False, first_tokens=0)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(exact))
        model(input_ids=token, **cache_kwargs(exact))
    near = exact.layers[2].storage.view(41)[0]
    s2 = scale.scales[2][:, None, :]  # divided back, the keys to 3 bits' error where they were coded (times s)
    assert float(((keys - near) * s2).norm() / (near * s2).norm()) < 0.3
    assert float((keys * s2 - near).norm() / near.norm()) > 0.5  # (not divided back: far from them)
    caches[0].save(tmp_path / "cache.safetensors")
    loaded = load_cache(tmp_path / "cache.safetensors", model.config)
    assert loaded.layers[2].storage.states()[0].scale is not None
    with torch.no_grad():
        want = model(input_ids=token, **cache_kwargs(caches[0])).logits
        got = model(input_ids=token, **cache_kwargs(loaded)).logits
    assert torch.equal(got, want)
