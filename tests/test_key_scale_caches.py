"""The key scale in every cache that codes keys in the rotated format: the paged-quantized cache (its pool holds the
scale in each layer's state) and the evicting caches with rotated bits (each slot codec's state), as in
`QuantizedCache` and `OffloadedCache` (tests/test_key_scale.py).

The shipped Gemma 3 270M scale is taken by those caches of that model and no other, the argument or the spec turns it
off; on the tiny Gemma 3, a paged cache with a scale gives the quantized cache's logits (the same codes), a slot codec
codes a token's keys as the codes of k * s (and without it the old codes), and a pool shared by caches refuses one that
asks for another scale.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_key_scale import pair_scale

from conformance.models import get_model
from hf_kvplus import H2OCache, PagedCache, PagedPool, QuantizedCache, SinkCache, cache_kwargs
from hf_kvplus.errors import CacheMismatchError
from hf_kvplus.key_scale import KeyScale
from hf_kvplus.model_spec import ModelSpec
from hf_kvplus.planning.configs import load_config
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.slots import TokenQuantCodec


def held_scales(cache) -> list:
    """The key scale of every coded layer's state (None where a state holds none)."""
    return [getattr(state, "scale", None) for layer in cache.layers for state in layer.storage.states()]


@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_the_shipped_scale_is_taken_by_paged_and_evicting_rotated_caches_of_gemma3_only(name, monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path))  # an empty user folder: the package data alone
    config = load_config(name)
    gemma = name == "gemma3-270m"
    for build in (lambda: PagedCache(config, bits="k4v2"), lambda: parse_cache_spec("paged-quantized:k3v2").build(config),
                  lambda: SinkCache(config, bits="k4v2"), lambda: H2OCache(config, budget=256, bits="k2v2"),
                  lambda: parse_cache_spec("sink:4:1020:bits=k3v2").build(config),
                  lambda: parse_cache_spec("snapkv:512:bits=k4v2").build(config)):  # fmt: skip
        cache = build()
        scales = held_scales(cache)
        assert scales and all((s is not None) == gemma for s in scales), type(cache).__name__
        assert (cache.quantized_report()["key_scale"] == "gemma3-270m") == gemma
    for off in (lambda: PagedCache(config, bits="k4v2", key_scale="off"),
                lambda: parse_cache_spec("paged-quantized:k4v2:key_scale=off").build(config),
                lambda: SinkCache(config, bits="k4v2", key_scale=None),
                lambda: parse_cache_spec("h2o:256:bits=k3v2:key_scale=off").build(config),
                lambda: PagedCache(config, bits=4), lambda: SinkCache(config, bits="int4")):  # fmt: skip
        cache = off()
        assert cache.quantized_report()["key_scale"] is None
        assert all(s is None for s in held_scales(cache))


def tiny_scale(model) -> KeyScale:
    """A wide scale for every layer of `model` (the tiny model's fitted ones are all near 1)."""
    spec, g = ModelSpec.from_config(model.config), torch.Generator().manual_seed(4)
    return KeyScale("tiny gemma3", model.config.model_type, spec.num_layers,
                    {s.index: pair_scale(s.num_kv_heads, s.head_dim, g) for s in spec.layers})  # fmt: skip


def decode_logits(model, cache, ids):
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
        return model(input_ids=torch.tensor([[7]]), **cache_kwargs(cache)).logits


def test_a_paged_cache_with_a_scale_codes_and_attends_as_the_quantized_cache():
    # The same tokens coded (window 16, blocks of 16, a fixed centre) with the same scale: the same codes, so the same
    # logits to float rounding (measured 1.7e-6); without the scale, the unscaled quantized cache's; and the two apart.
    model = get_model("gemma3")
    scale = tiny_scale(model)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(2))
    logits = {}
    for key_scale in (scale, "off"):
        quantized = QuantizedCache(model.config, bits="k3v2", window=16, family_defaults=False, first_tokens=0,
                                   turning_keys=False, key_scale=key_scale)  # fmt: skip
        paged = PagedCache(model.config, bits="k3v2", window=16, block_size=16, key_scale=key_scale)
        logits[key_scale is scale] = [decode_logits(model, c, ids) for c in (quantized, paged)]
        assert (paged.quantized_report()["key_scale"] is None) == (key_scale == "off")
        full = 2  # (the tiny model's full-attention layer)
        kq, kp = quantized.layers[full].storage.view(49)[0], paged.layers[full].storage.view(49)[0]
        assert torch.equal(kq[:, :, :32], kp[:, :, :32])  # the coded tokens, read back alike
    for scaled in (True, False):
        torch.testing.assert_close(logits[scaled][1], logits[scaled][0], atol=2e-5, rtol=0)
    assert float((logits[True][1] - logits[False][1]).abs().max()) > 0.1


def test_a_shared_pool_codes_with_its_scale_and_refuses_a_cache_asking_for_another():
    model = get_model("gemma3")
    scale = tiny_scale(model)
    pool = PagedPool(model.config, bits="k3v2", key_scale=scale)
    assert all(layer.state.scale is not None for layer in pool.layers.values())
    for same in ("auto", scale):
        assert held_scales(PagedCache(model.config, pool=pool, key_scale=same))
    with pytest.raises(CacheMismatchError, match="key scale tiny gemma3's; the cache asks for none"):
        PagedCache(model.config, pool=pool, key_scale="off")
    plain = PagedPool(model.config, bits="k3v2")
    with pytest.raises(CacheMismatchError, match="key scale none; the cache asks for tiny gemma3's"):
        PagedCache(model.config, pool=plain, key_scale=scale)
    assert all(s is None for s in held_scales(PagedCache(model.config, pool=plain, key_scale=None)))


@pytest.mark.parametrize("bits", ["k3v2", "k4v4"])
def test_an_evicting_caches_slot_codes_are_the_codes_of_the_scaled_keys(bits):
    # The codec of an evicting cache's full layer, fresh (its centre unset): with the scale, a token's key codes are
    # those an unscaled codec gives k * s (centre and codes in that space), and read back divided; with key_scale="off"
    # the codes of k themselves, as before the scale.
    model = get_model("gemma3")
    scale = tiny_scale(model)
    full = 2
    s = scale.scales[full][None, :, None, :]
    k = torch.randn(1, 1, 24, model.config.head_dim, generator=torch.Generator().manual_seed(6)) * 3

    def codec(key_scale) -> TokenQuantCodec:
        return SinkCache(model.config, bits=bits, window=64, key_scale=key_scale).layers[full].storage.codec

    scaled, plain, reference = codec(scale), codec("off"), codec("off")
    assert scaled.state.scale is not None and (plain.state is None or plain.state.scale is None)
    codes = scaled.encode_keys(k)
    by_hand = reference.encode_keys(k * s)
    assert codes.keys() == by_hand.keys() and all(torch.equal(codes[f], by_hand[f]) for f in codes)
    unscaled = plain.encode_keys(k)
    assert not torch.equal(codes["k"], unscaled["k"])
    assert all(torch.equal(unscaled[f], TokenQuantCodec(plain.fmt, plain.fmt.make_state()).encode_keys(k)[f])
               for f in unscaled)  # fmt: skip
    back = scaled.decode_keys(codes, torch.float32)
    torch.testing.assert_close(back, reference.decode_keys(by_hand, torch.float32) / s)
    assert float(((back - k) * s).norm() / (k * s).norm()) < 0.25  # the format's error, where it was coded


def test_an_evicting_cache_with_a_scale_decodes_with_the_keys_divided_back():
    # End to end on the tiny Gemma 3: a sink cache holding every token coded k4v4, with the scale, reads keys back near
    # the exact cache's and gives logits near its own; a scale that is not divided back would put them far apart.
    model = get_model("gemma3")
    scale = tiny_scale(model)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    caches = {name: SinkCache(model.config, window=100, first_tokens=0, **kw)
              for name, kw in (("exact", {}), ("scaled", {"bits": "k4v4", "key_scale": scale}),
                               ("off", {"bits": "k4v4", "key_scale": "off"}))}  # fmt: skip
    logits = {name: decode_logits(model, cache, ids) for name, cache in caches.items()}
    full, s = 2, scale.scales[2][None, :, None, :]
    exact = caches["exact"].layers[full].storage.view(41)[0]
    keys = caches["scaled"].layers[full].storage.view(41)[0]
    assert float(((keys - exact) * s).norm() / (exact * s).norm()) < 0.25
    assert float((keys * s - exact).norm() / exact.norm()) > 0.5
    spread = float((logits["off"] - logits["exact"]).abs().max())
    assert float((logits["scaled"] - logits["exact"]).abs().max()) < 3 * spread + 0.05
    assert not torch.equal(logits["scaled"], logits["off"])


def test_calibrate_measures_with_the_models_scale_and_reuses_only_what_was_measured_so(monkeypatch, tmp_path):
    # A scale found for the model (the user folder, as `kvplus key-scale` writes it) is on in every cache the calibration
    # measures, which records it; options measured without it are not taken.
    from hf_kvplus import fitted
    from hf_kvplus.errors import ConfigError
    from hf_kvplus.evaluation.calibrate import calibrate

    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path))
    model = get_model("gemma3")
    folder = fitted.user_dir(model.config, "key_scale")
    folder.mkdir(parents=True)
    tiny_scale(model).save(folder / "key_scale.safetensors")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    args = dict(model_name="tiny-gemma3", bits="k2v2", candidates=("k3v2",), max_bits=16.0, chunk_size=16, window=16,
                progress=False)  # fmt: skip
    scaled, _ = calibrate(model, ids, **args)
    assert scaled.measured["key_scale"] == "tiny gemma3"
    unscaled = replace(scaled, measured=scaled.measured | {"key_scale": None})
    with pytest.raises(ConfigError, match="measured otherwise.*key_scale"):
        calibrate(model, ids, reuse=[unscaled], **args)


@pytest.mark.slow  # (as the Gemma 3 cases of tests/test_compile_fullgraph.py: 85 s each)
@pytest.mark.parametrize("spec", ["paged-quantized:k4v2:window=8:block=8", "h2o:8:bits=k4v2"])
def test_a_scaled_paged_or_evicting_decode_step_compiles_as_one_graph(spec, tmp_path):
    # As tests/test_compile_fullgraph.py, on the tiny Gemma 3 with a key scale given by the spec (`key_scale=PATH`).
    from test_compile_fullgraph import MAX_GRAPHS, PROMPT, STEPS, greedy
    from torch._dynamo.utils import counters

    from conformance.modes import make_prompt

    torch._dynamo.reset()
    model = get_model("gemma3")
    path = tiny_scale(model).save(tmp_path / "key_scale.safetensors")
    cache_spec = parse_cache_spec(f"{spec}:key_scale={path}")
    ids = make_prompt(PROMPT, batch=2)
    built = cache_spec.build(model.config)
    assert built.quantized_report()["key_scale"] == "tiny gemma3"
    eager = greedy(model, built, ids, model)
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=STEPS):
        assert greedy(model, cache_spec.build(model.config), ids, compiled) == eager
    assert counters["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(counters["stats"])
