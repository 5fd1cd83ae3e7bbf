"""Rotated formats wherever quantized storage goes: QuantizedCache (growing and static), PagedCache, the evicting
caches and OffloadedCache; named by key and value bits and by spec strings; bytes at rest from first principles;
error bounds against full precision (the fused decode path against the dense one: test_quantized_cache.py)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import (
    ConfigError,
    H2OCache,
    OffloadedCache,
    PagedCache,
    QuantizedCache,
    SinkCache,
    cache_kwargs,
)
from hf_kvplus.eviction.rope import RotaryShift
from hf_kvplus.kernels.rotated_format import RotatedFormat
from hf_kvplus.specs import parse_cache_spec


def config(head_dim=64):
    return LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        head_dim=head_dim, vocab_size=64, intermediate_size=64,
    )  # fmt: skip


@pytest.mark.parametrize("bits, limit", [((4, 2), 3.3), ((3, 2), 2.8), ((2, 2), 2.3), ((4, 4), 4.3)])
def test_bits_per_coordinate_from_first_principles(bits, limit):
    cfg = config()
    cache = QuantizedCache(cfg, key_bits=bits[0], value_bits=bits[1], first_tokens=0)  # the codes alone: no sinks
    for layer in range(2):
        shape = (1, 2, 128 + 320, 64)
        cache.update(torch.randn(shape, dtype=torch.float16), torch.randn(shape, dtype=torch.float16), layer)
    report = cache.quantized_report()
    # kb + vb bits per coordinate pair, plus a float16 norm per vector of 64: over float16's 2 x 16 bits.
    assert report["ratio_to_fp16"] == pytest.approx((bits[0] + bits[1]) / 32 + 1 / 64)
    assert 16 * report["ratio_to_fp16"] <= limit
    assert report["quantized_tokens"] == 320 and report["format"] == f"k{bits[0]}v{bits[1]}"


def test_named_by_key_and_value_bits_and_by_spec_strings():
    cfg = config()
    assert QuantizedCache(cfg, key_bits=3, value_bits=2).format == RotatedFormat(3, 2)
    assert QuantizedCache(cfg, key_bits=4).format == RotatedFormat(4, 4)
    assert QuantizedCache(cfg, bits="k4v2", rotation_seed=7).format == RotatedFormat(4, 2, 7)
    assert QuantizedCache(cfg, bits=4).format.bits == 4, "int4 keeps meaning KIVI"
    for text, fmt in [("quantized:k4v2", RotatedFormat(4, 2)), ("quantized:k3v2:window=64", RotatedFormat(3, 2)),
                      ("paged-quantized:k2v2:block=16", RotatedFormat(2, 2))]:  # fmt: skip
        assert parse_cache_spec(text).build(cfg).format == fmt
    for text in ["sink:4:60:bits=k4v2", "h2o:64:bits=k3v2", "offloaded-quantized:k4v4"]:
        parse_cache_spec(text).build(cfg)


@pytest.mark.parametrize("kwargs, match", [
    (dict(key_bits=5, value_bits=2), "key_bits must be one of"),
    (dict(bits=4, key_bits=4), "not both"),
    (dict(bits="k4v2", group_size=32), "no groups"),
    (dict(bits="k4v7"), "key and value bits in"),
    (dict(bits="k4v2", backend="quanto"), "codes the KIVI formats only"),
])  # fmt: skip
def test_bad_rotated_settings_are_refused_with_the_numbers(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        QuantizedCache(config(), **kwargs)
    with pytest.raises(ConfigError, match="head_dim 36 is not a multiple of 8"):
        QuantizedCache(config(head_dim=36), bits="k4v2")


CACHES = {
    "quantized": lambda cfg, bits: QuantizedCache(cfg, bits=bits, window=4),
    "static": lambda cfg, bits: QuantizedCache(cfg, bits=bits, window=4, max_tokens=128),
    "paged": lambda cfg, bits: PagedCache(cfg, bits=bits, window=4, block_size=8),
    "sink": lambda cfg, bits: SinkCache(cfg, num_sinks=2, window=100, bits=bits),
    "h2o": lambda cfg, bits: H2OCache(cfg, budget=100, bits=bits),
    "offloaded": lambda cfg, bits: OffloadedCache(cfg, bits=bits, window=4),
}


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_every_quantized_storage_takes_the_rotated_formats(kind, arch):
    """A decode step over the rotated past is close to full precision's, closer at more bits, and not equal (so the
    step reads the codes)."""
    model = get_model(arch)
    prompt, step = make_prompt(30, seed=4), torch.tensor([[5]])
    dyn = DynamicCache(config=model.config)
    model(prompt, **cache_kwargs(dyn))
    ref = model(step, **cache_kwargs(dyn)).logits
    errors = {}
    for bits in ("k2v2", "k4v4", "k8v8"):
        cache = CACHES[kind](model.config, bits)
        model(prompt, **cache_kwargs(cache))
        got = model(step, **cache_kwargs(cache)).logits
        errors[bits] = (got - ref).abs().max().item()
    if kind in ("sink", "h2o") and arch == "mistral":  # evicting caches keep sliding layers exact; all are here
        assert set(errors.values()) == {0.0}
        return
    # The tiny models' head_dim is 16: a rotated format codes few coordinates per norm there.
    assert 0 < errors["k8v8"] < errors["k4v4"] < errors["k2v2"]
    assert errors["k8v8"] < 0.1 * ref.abs().max()


def offset_keys(batch, tokens, seed, heads=2, head_dim=64):
    """Keys [batch, heads, tokens, head_dim] sharing a large offset per head, token 0 (a sink) opposite to it: farther
    from the offset than from 0. Drawn on the CPU (the same keys on every device), on torch's default device."""
    g = torch.Generator().manual_seed(seed)
    offset = 4 * torch.randn(heads, 1, head_dim, generator=g, device="cpu")
    keys = torch.randn(batch, heads, tokens, head_dim, generator=g, device="cpu") + offset
    keys[:, :, 0] = torch.randn(batch, heads, head_dim, generator=g, device="cpu") - 3 * offset[:, 0]
    return keys.to(torch.get_default_device())


def turned(keys: torch.Tensor, cfg) -> torch.Tensor:
    """`keys` [B, H, T, D] as the model's RoPE leaves them: token t turned to position t."""
    positions = torch.arange(keys.shape[2]).expand(*keys.shape[:2], -1)
    return RotaryShift.from_config(cfg).unturned(keys, -positions)


@pytest.mark.parametrize("kind", ["quantized", "static", "paged", "offloaded"])
def test_keys_are_coded_relative_to_a_centre(kind, monkeypatch):
    """With a common offset per head (before RoPE where the storage's centre turns with it, after RoPE where it is
    fixed), centred keys decode closer than plain ones (same bytes); the far-off sink is coded plainly, not relative
    to the centre, and decodes no worse than a plain code would."""
    from hf_kvplus.kernels import rotated_format

    turning = kind in ("quantized", "static", "offloaded")  # where the default centre turns (not a paged pool's)
    keys, values = offset_keys(2, 120, seed=1), torch.randn(2, 2, 120, 64)
    keys = turned(keys, config()) if turning else keys
    errors = {}
    for centred in (True, False):
        monkeypatch.setattr(rotated_format, "CENTER_KEYS", centred)
        cache = CACHES[kind](config(), "k2v2")
        cache.update(keys, values, 0)
        held = cache.layers[0].keys
        errors[centred] = ((held - keys).norm(dim=-1) / keys.norm(dim=-1))[:, :, :100]  # the window is exact
        center = cache.layers[0].storage.states()[0]
        assert (center is not None) == centred and (not centred or (center.turns is not None) == turning)
    assert errors[True][:, :, 1:].mean() < 0.5 * errors[False][:, :, 1:].mean(), errors
    assert torch.allclose(errors[True][:, :, 0], errors[False][:, :, 0]), "the sink was coded relative to the centre"


def test_the_turning_centre_codes_rope_keys_closer_and_switches_off():
    """Keys with a pre-RoPE offset, as a model's: the default (turning) centre decodes them closer than a fixed one
    (`turning_keys=False`, spec `center=fixed`)."""
    cfg = config()
    keys, values = turned(offset_keys(1, 300, seed=5), cfg), torch.randn(1, 2, 300, 64)
    errors = {}
    for kind, cache in (("turning", QuantizedCache(cfg, bits="k3v2", window=8)),
                        ("fixed", parse_cache_spec("quantized:k3v2:window=8:center=fixed").build(cfg))):  # fmt: skip
        cache.update(keys, values, 0)
        center = cache.layers[0].storage.states()[0]
        assert (center.turns is not None) == (kind == "turning") and center.mu is not None
        errors[kind] = ((cache.layers[0].keys - keys).norm(dim=-1) / keys.norm(dim=-1))[:, :, 4:290].mean()
    assert errors["turning"] < 0.7 * errors["fixed"], errors


@pytest.mark.parametrize("path", ["operator", "twin"])
def test_a_decode_step_reads_the_turning_centre_as_the_dense_view_does(path, monkeypatch):
    """A decode step over turning-centre codes (the C++ operator, or the twin where it is not built) gives the logits of
    a dense attention over the cache's decoded keys and values (the dense view, made as a prefill reads the codes)."""
    from hf_kvplus.kernels import rotated_cpu

    if path == "twin":
        monkeypatch.setattr(rotated_cpu, "available", lambda: False)
    model = get_model("llama")
    prompt, step = make_prompt(60, seed=2), torch.tensor([[7]])
    cache = QuantizedCache(model.config, bits="k3v2", window=4)
    model(prompt, **cache_kwargs(cache))
    assert all(layer.storage.states()[0].turns is not None for layer in cache.layers)
    dense = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        dense.update(layer.keys.clone(), layer.values.clone(), i)
    got, want = (model(step, **cache_kwargs(c)).logits for c in (cache, dense))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    fixed = QuantizedCache(model.config, bits="k3v2", window=4, turning_keys=False)  # a centre that does not turn
    model(prompt, **cache_kwargs(fixed))
    assert not torch.allclose(model(step, **cache_kwargs(fixed)).logits, want, atol=1e-3)


def test_the_static_storage_codes_decode_steps_at_their_positions():
    """Keys with a pre-RoPE offset, written one decode step at a time into the static storage, which codes each group
    as it leaves the window: relative to the turning centre at the group's positions they decode far closer than
    relative to a fixed centre (a group coded at the wrong positions would not)."""
    cfg = config()
    keys, values = turned(offset_keys(1, 200, seed=6), cfg), torch.randn(1, 2, 200, 64)
    errors = {}
    for centre in ("turning", "fixed"):
        cache = QuantizedCache(cfg, bits="k3v2", window=8, max_tokens=256, turning_keys=centre == "turning")
        cache.update(keys[:, :, :40], values[:, :, :40], 0)  # the prefill sets the centre
        for t in range(40, 200):
            cache.update(keys[:, :, t : t + 1], values[:, :, t : t + 1], 0)
        held = cache.layers[0].keys
        errors[centre] = ((held - keys).norm(dim=-1) / keys.norm(dim=-1))[:, :, 48:180].mean()
    assert errors["turning"] < 0.7 * errors["fixed"], errors


def test_the_static_storage_reads_its_turning_codes_alike_on_every_path(monkeypatch):
    """The static storage (`max_tokens`: token p at code position p) codes keys relative to the turning centre at
    their positions as a decode step quantizes them, inside the step: the C++ operator's steps and the twin's give
    the same logits from the same state, and the same steps with a fixed centre differ."""
    import copy

    from hf_kvplus.kernels import rotated_cpu

    model = get_model("llama")
    prompt, steps = make_prompt(60, seed=2), [torch.tensor([[t]]) for t in (7, 11, 3, 5, 9, 2, 8, 4, 6, 1)]
    logits = {}
    for centre in ("turning", "fixed"):
        cache = QuantizedCache(model.config, bits="k3v2", window=4, max_tokens=128, turning_keys=centre == "turning")
        model(prompt, **cache_kwargs(cache))
        assert all((layer.storage.states()[0].turns is not None) == (centre == "turning") for layer in cache.layers)
        for path in ("operator", "twin"):
            if path == "twin":
                monkeypatch.setattr(rotated_cpu, "available", lambda: False)
            run = copy.deepcopy(cache)  # ten steps: groups leave the window and are coded inside steps
            logits[centre, path] = torch.cat([model(step, **cache_kwargs(run)).logits for step in steps], dim=1)
            monkeypatch.undo()
    torch.testing.assert_close(logits["turning", "operator"], logits["turning", "twin"], atol=2e-4, rtol=1e-4)
    assert not torch.allclose(logits["turning", "operator"], logits["fixed", "operator"], atol=1e-3)


def test_a_turning_centre_where_it_cannot_turn_is_refused():
    with pytest.raises(ConfigError, match="only a rotated format"):
        QuantizedCache(config(), bits="int4", turning_keys=True)
    static = QuantizedCache(config(), bits="k4v2", max_tokens=256)  # left to the default: turning there too
    static.update(torch.randn(1, 2, 70, 64), torch.randn(1, 2, 70, 64), 0)
    assert static.layers[0].storage.states()[0].turns is not None
    with pytest.raises(ConfigError, match="center must be"):
        parse_cache_spec("quantized:k4v2:center=spinning").build(config())


def test_a_centre_is_set_once_and_shared_by_a_pools_caches():
    """The first keys a layer quantizes set its centre; later keys, another cache of the same paged pool and a reset
    leave it as it was, so every stored code (a reused prefix block included) keeps its meaning."""
    from hf_kvplus import PagedPool

    cfg = config()
    pool = PagedPool(cfg, bits="k3v2", block_size=8)
    first, second = PagedCache(cfg, pool=pool, window=8), PagedCache(cfg, pool=pool, window=8)
    first.update(offset_keys(1, 64, seed=2), torch.randn(1, 2, 64, 64), 0)
    center = first.layers[0].storage.states()[0]
    mu = center.mu.clone()
    held = first.layers[0].keys.clone()
    second.update(offset_keys(1, 64, seed=3) + 5, torch.randn(1, 2, 64, 64), 0)
    first.update(offset_keys(1, 40, seed=4) - 5, torch.randn(1, 2, 40, 64), 0)
    assert second.layers[0].storage.states()[0] is center and torch.equal(center.mu, mu)
    assert torch.equal(first.layers[0].keys[:, :, :48], held[:, :, :48]), "codes changed meaning"
    first.reset()
    assert first.layers[0].storage.states()[0] is center and torch.equal(center.mu, mu)
