"""Cache spec strings: every family builds its cache; malformed specs are refused with the reason."""

import pytest
import torch
from transformers import DynamicCache, QuantizedCache, StaticCache

from conformance.models import build_model, make_config
from hf_kvplus import ConfigError, DenseCache, PagedCache, cache_kwargs
from hf_kvplus.memory import cache_bytes
from hf_kvplus.specs import available_cache_specs, parse_cache_spec


@pytest.mark.parametrize(
    "text, cls",
    [("dynamic", DynamicCache), ("static", StaticCache), ("static:64", StaticCache), ("dense", DenseCache),
     ("dense:max_tokens=64", DenseCache), ("paged", PagedCache), ("paged:block=8:blocks=40", PagedCache), ("hf-quantized:quanto:4", QuantizedCache),
     ("hf-quantized:quanto:2:residual=16:group=32", QuantizedCache)],
)
def test_specs_build_their_cache_and_it_serves_the_model(text, cls):
    model = build_model("llama")
    cache = parse_cache_spec(text).build(model.config, max_length=40)
    assert isinstance(cache, cls)
    ids = torch.randint(3, 128, (1, 30))
    model(ids, **cache_kwargs(cache))
    assert cache.get_seq_length() == 30 and cache_bytes(cache) > 0


def test_spec_options_reach_the_cache():
    config = make_config("llama")
    assert parse_cache_spec("static:64").build(config).get_max_length() == 64
    assert parse_cache_spec("dense:max_tokens=50").build(config).layers[0].storage.max_tokens == 50
    paged = parse_cache_spec("paged:block=8:blocks=40").build(config)
    assert paged.block_size == 8 and paged.block_pools()["full"].capacity == 40
    quantized = parse_cache_spec("hf-quantized:quanto:2:residual=16:group=32").build(config)
    model = build_model("llama")
    model(torch.randint(3, 128, (1, 20)), **cache_kwargs(quantized))
    layer = quantized.layers[0]
    assert (layer.nbits, layer.residual_length, layer.q_group_size) == (2, 16, 32)


def test_available_specs_start_with_the_baseline_and_all_parse():
    specs = available_cache_specs()
    assert specs[0] == "dynamic" and "dense" in specs
    assert all(parse_cache_spec(s).text == s for s in specs)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "non-empty"),
        ("nope", r"unknown cache 'nope'.*known: \["),
        ("dynamic:3", "at most 0 positional"),
        ("static:zero", "max_cache_len .* must be an integer, got 'zero'"),
        ("static:0", "must be >= 1, got 0"),
        ("dense:size=3", r"unknown options \['size'\]"),
        ("dense:max_tokens=", "expected key=value"),
        ("hf-quantized:quanto:3", r"quanto supports \(2, 4\) bits, got 3"),
        ("hf-quantized:gptq:4", "expected hf-quantized:<quanto|hqq>:<bits>"),
        ("hf-quantized:quanto:4:residual=0", "residual .* must be >= 1, got 0"),
        ("dense:max_tokens=4:extra", "positional argument 'extra' after key=value"),
        ("paged:size=4", r"unknown options \['size'\]"),
        ("paged:blocks=0", "blocks in cache spec 'paged:blocks=0' must be >= 1, got 0"),
    ],
)
def test_bad_specs_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_cache_spec(text)


def test_static_without_a_length_says_how_to_give_one():
    with pytest.raises(ConfigError, match="static:<max_cache_len>"):
        parse_cache_spec("static").build(make_config("llama"))


@pytest.mark.parametrize(
    "text, cls, policy",
    [
        ("sink:4:1020", "SinkCache", "SinkPolicy(num_sinks=4, window=1020, positions='cache')"),
        ("sink:0:64:positions=original", "SinkCache", "SinkPolicy(num_sinks=0, window=64, positions='original')"),
        ("h2o:256:recent=32", "H2OCache", "HeavyHitterPolicy(budget=256, recent=32)"),
        ("snapkv:256:observation=16:kernel=5:pooling=max", "SnapKVCache",
         "SnapKVPolicy(budget=256, observation=16, kernel_size=5, pooling='max')"),
    ],
)
def test_evicting_specs_build_their_cache(text, cls, policy):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         vocab_size=32, intermediate_size=32)
    cache = parse_cache_spec(text).build(config)
    assert type(cache).__name__ == cls
    assert repr(cache.layers[0].retention) == policy


@pytest.mark.parametrize(
    "text, match",
    [("sink:4", "expected sink:<num_sinks>:<window>"), ("h2o:-1", "must hold at least 1 token, got budget=-1"),
     ("snapkv:64:pooling=median", "pooling must be one of"), ("sink:4:8:bits=int3", "got 'int3'"),
     ("h2o:8:window=4", "unknown options")],
)
def test_bad_evicting_specs_are_refused(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_cache_spec(text)


def _filled(text: str):
    """A cache built from `text` on the tiny llama config, layer 0 given 40 tokens (32 past an 8-token window)."""
    config = make_config("llama")
    cache = parse_cache_spec(text).build(config)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, heads, 40, dim, generator=generator) for _ in range(2))
    cache.update(k, v, 0)
    return cache


@pytest.mark.parametrize("name", ["quantized:k4v2", "quantized:k3v2:max_tokens=64", "offloaded-quantized:k4v2"])
def test_the_seed_option_picks_the_rotations(name):
    caches = {seed: _filled(f"{name}:window=8:seed={seed}") for seed in (3, 4)}
    for seed, cache in caches.items():
        assert [layer.storage.fmt.seed for layer in cache.layers] == [seed + i for i in range(len(cache.layers))]
    default = _filled(f"{name}:window=8")
    assert [layer.storage.fmt.seed for layer in default.layers] == list(range(len(default.layers)))
    codes = {seed: cache.layers[0].storage.view(40)[0] for seed, cache in caches.items()}
    # (a static rotated storage holds its window rotated, in the model's dtype: one rounding each way)
    assert torch.allclose(codes[3][:, :, 32:], codes[4][:, :, 32:], atol=1e-5, rtol=0), "the window is exact"
    assert not torch.allclose(codes[3][:, :, :32], codes[4][:, :, :32], atol=1e-3), "another seed, other codes"
    again = _filled(f"{name}:window=8:seed=3").layers[0].storage.view(40)[0]
    assert torch.equal(again, codes[3]), "the same seed, the same codes"


@pytest.mark.parametrize(
    "text, message",
    [("quantized:k4v2:seed=-1", "seed in cache spec 'quantized:k4v2:seed=-1' must be >= 0, got -1"),
     ("quantized:k4v2:seed=one", "seed .* must be an integer, got 'one'"),
     ("offloaded-quantized:k3v2:seed=1.5", "must be an integer, got '1.5'"),
     ("quantized:int4:seed=1", "seed=1 picks a rotated format's rotations; 'int4' is not rotated"),
     ("offloaded-quantized:fp8:seed=2", "seed=2 .* 'fp8' is not rotated"),
     ("paged-quantized:k4v2:seed=1", r"unknown options \['seed'\]"),
     ("offloaded:seed=1", r"unknown options \['seed'\]")],
)
def test_bad_seeds_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_cache_spec(text)


def test_a_spec_whose_extra_is_missing_is_skipped_and_refused_with_a_typed_error(monkeypatch):
    """Without optimum installed at all (not only optimum.quanto), the quanto spec is not offered and building it
    raises ConfigError naming the module and the extra that installs it, rather than ModuleNotFoundError from the
    availability check."""
    import sys

    monkeypatch.setitem(sys.modules, "optimum", None)  # what an environment without the package looks like
    monkeypatch.delitem(sys.modules, "optimum.quanto", raising=False)  # (imported by an earlier test)
    spec = parse_cache_spec("hf-quantized:quanto:4")
    assert not spec.kind.available()
    assert "hf-quantized:quanto:4" not in available_cache_specs()
    with pytest.raises(ConfigError, match=r"optimum\.quanto.*pip install 'hf-kvplus\[quanto\]'"):
        spec.build(make_config("llama"))
