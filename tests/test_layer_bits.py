"""Per-layer formats (`layer_bits`) in every quantized storage, and the calibration that chooses them
(`Calibration`, `calibrate`, `kvplus calibrate`, the `calibration=PATH` spec option)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from test_kvzap import random_surrogate
from transformers import DynamicCache

from conformance.models import get_model
from hf_kvplus import CacheMismatchError, ConfigError, PagedCache, QuantizedCache, UnsupportedOperationError
from hf_kvplus.calibration import Calibration
from hf_kvplus.evaluation.calibrate import LayerOption, calibrate, choose
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.dense import DenseStorage
from hf_kvplus.storage.static_quantized import StaticQuantizedStorage


@pytest.fixture
def config():
    config = get_model("llama").config
    assert config.num_hidden_layers == 3
    return config


SPECS = ["quantized:int2:group=4:window=8", "quantized:int2:group=4:window=8:max_tokens=64",
         "paged-quantized:int2:group=4:window=8:block=8", "offloaded-quantized:int2:group=4:window=8"]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS)
def test_every_quantized_storage_holds_a_layer_in_its_own_format(spec, config, tmp_path):
    path = Calibration("tiny", config.model_type, 3, "int2", {1: 8}, 9.0, 0.0).save(tmp_path / "c.json")
    cache = parse_cache_spec(f"{spec}:calibration={path}").build(config)
    assert [getattr(layer.storage, "fmt", None) is not None or hasattr(layer.storage, "segment")
            for layer in cache.layers] == [True] * 3  # fmt: skip
    bits = [layer.storage.fmt.bits if hasattr(layer.storage, "fmt") else layer.storage.segment.fmt.bits
            for layer in cache.layers]  # fmt: skip
    assert bits == [2, 8, 2]
    if "max_tokens" in spec:
        assert all(isinstance(layer.storage, StaticQuantizedStorage) for layer in cache.layers)
    errors = _key_errors(cache, config, coded=24)  # the coded part (the window, 16 tokens, is exact)
    assert errors[1] < errors[0] / 8 and errors[1] < errors[2] / 8, f"layer 1 is not held at 8 bits: {errors}"


def _key_errors(cache, config, coded: int) -> list[float]:
    """Each layer's key error over the first `coded` of 40 random tokens the cache took."""
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = torch.randn(1, heads, 40, dim), torch.randn(1, heads, 40, dim)
    errors = []
    for index in range(3):
        cache.update(k, v, index)
        got, _ = cache.layers[index].storage.view(40)
        errors.append((got - k)[:, :, :coded].norm().item())
    return errors


def test_layer_bits_full_precision_and_precedence_over_boundary(config):
    cache = QuantizedCache(config, bits=4, group_size=4, window=8, boundary_layers=1, layer_bits={2: 2, 1: None})
    assert [type(layer.storage) for layer in cache.layers][1] is DenseStorage
    assert isinstance(cache.layers[0].storage, DenseStorage)  # the boundary's (full precision)
    assert cache.layers[2].storage.fmt.bits == 2  # its own entry wins over the boundary
    assert cache.regions.layer_bits == ((1, None), (2, 2))


def test_bits_per_coordinate_count_each_layers_format(config):
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    cache = QuantizedCache(config, bits=4, group_size=4, window=8, layer_bits={1: 8})
    k, v = torch.randn(1, heads, 40, dim), torch.randn(1, heads, 40, dim)
    for index in range(3):
        cache.update(k, v, index)
    # int4 and int8, groups of 4 tokens (keys) and 4 channels (values), float16 scale and zero: bits + 8
    assert cache.quantized_report()["bits_per_coordinate"] == pytest.approx((12 + 16 + 12) / 3)


def test_bad_layer_bits_are_refused(config):
    with pytest.raises(ConfigError, match=r"names layers \[3\], but the model has 3 \(0..2\)"):
        QuantizedCache(config, bits=4, layer_bits={3: 8})
    with pytest.raises(ConfigError, match="layer indices"):
        QuantizedCache(config, bits=4, layer_bits={-1: 8})
    with pytest.raises(ConfigError):
        QuantizedCache(config, bits=4, layer_bits={0: 5})
    with pytest.raises(ConfigError, match="layer_bits=.* need bits"):  # a lossless paged cache: no layer formats
        PagedCache(config, layer_bits={0: 8})


def test_paged_prefix_reuse_refuses_per_layer_formats(config):
    cache = PagedCache(config, bits=4, group_size=4, window=8, block_size=8, layer_bits={1: 8})
    with pytest.raises(UnsupportedOperationError, match=r"layers \[1\] hold their own"):
        cache.reuse_prefix(torch.arange(40))


def test_a_calibration_round_trips_and_refuses_another_model_or_format(config, tmp_path):
    calibration = Calibration("tiny", config.model_type, 3, "k4v2", {0: "k4v3", 2: None}, 3.5, 3.4, {"text": "t"})
    path = calibration.save(tmp_path / "c.json")
    assert json.loads(path.read_text())["layer_bits"] == {"0": "k4v3", "2": None}
    assert Calibration.load(path) == calibration
    calibration.check(config, "k4v2")
    with pytest.raises(ConfigError, match="bits='k4v2'; the cache asks for bits='k3v2'"):
        calibration.check(config, "k3v2")
    other = Calibration("big", config.model_type, 5, "k4v2", {}, 3.5, 3.4)
    with pytest.raises(CacheMismatchError, match="5 layers"):
        other.check(config)
    with pytest.raises(ConfigError, match="no calibration file"):
        Calibration.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="layer 7"):
        Calibration("tiny", config.model_type, 3, "k4v2", {7: "k4v3"}, 3.5, 3.4)
    with pytest.raises(ConfigError, match="bits='k4v2'"):
        parse_cache_spec(f"quantized:k3v2:calibration={path}")


def _best_by_search(options, budget):
    """Every assignment of at most one option per layer: the most summed gain within `budget` added bits."""
    layers = sorted({o.layer for o in options})
    choices = [[None, *(o for o in options if o.layer == layer)] for layer in layers]
    best = max(
        (sum(o.gain for o in pick if o), -sum(o.added_bits for o in pick if o), pick)
        for pick in itertools.product(*choices)
        if sum(o.added_bits for o in pick if o) <= budget + 1e-9
    )
    return {o.layer: o.bits for o in best[2] if o}


def _greedy(options, base_bits, max_bits):
    """The allocation `choose` replaced: gain per added bit, best first, one per layer, while the bits fit."""
    chosen, total = {}, base_bits
    for option in sorted(options, key=lambda o: o.gain / o.added_bits, reverse=True):
        if option.gain > 0 and option.layer not in chosen and total + option.added_bits <= max_bits + 1e-9:
            chosen[option.layer] = option.bits
            total += option.added_bits
    return chosen


def test_choose_is_the_optimum_within_the_budget_where_the_greedy_is_not():
    options = [
        LayerOption(0, "k4v3", 0.0, 0.0, gain=0.30, added_bits=0.10),  # 3.0 per bit
        LayerOption(0, "k4v4", 0.0, 0.0, gain=0.40, added_bits=0.20),  # 2.0 per bit, same layer: not both
        LayerOption(1, "k4v3", 0.0, 0.0, gain=0.25, added_bits=0.10),  # 2.5
        LayerOption(2, "k4v3", 0.0, 0.0, gain=-0.01, added_bits=0.10),  # no gain: never
        LayerOption(3, "k4v3", 0.0, 0.0, gain=0.05, added_bits=0.10),  # 0.5
    ]
    assert choose(options, base_bits=3.25, max_bits=3.46) == {0: "k4v3", 1: "k4v3"}
    assert choose(options, base_bits=3.25, max_bits=3.30) == {}
    # 0.55 bits: the greedy takes layer 0 at k4v3 first and has no room left for k4v4 (gain 0.60); the optimum 0.70
    assert _greedy(options, 3.25, 3.80) == {0: "k4v3", 1: "k4v3", 3: "k4v3"}
    assert choose(options, base_bits=3.25, max_bits=3.80) == {0: "k4v4", 1: "k4v3", 3: "k4v3"}
    assert choose(options, base_bits=3.25, max_bits=3.80) == _best_by_search(options, 0.55)
    free = LayerOption(4, "k3v3", 0.0, 0.0, gain=0.01, added_bits=0.0)  # as many bits as the base: taken if it gains
    assert choose([*options, free], base_bits=3.25, max_bits=3.30) == {4: "k3v3"}
    # a layer at fewer bits that loses little funds an upgrade that gains more
    down = LayerOption(5, "k3v2", 0.0, 0.0, gain=-0.02, added_bits=-0.10)
    assert choose([*options, down], base_bits=3.25, max_bits=3.46) == {0: "k4v4", 1: "k4v3", 5: "k3v2"}
    assert choose([*options, down], base_bits=3.25, max_bits=3.30) == {0: "k4v3", 5: "k3v2"}


def test_choose_matches_a_search_of_every_assignment():
    generator = random.Random(0)
    for _ in range(30):
        options = [
            LayerOption(layer, f"f{k}", 0.0, 0.0, gain=generator.uniform(-0.2, 1.0), added_bits=added)
            for layer in range(5)
            for k, added in enumerate(generator.sample([-0.1, -0.05, 0.05, 0.1, 0.15, 0.2], 3))
        ]
        budget = generator.choice([0.0, 0.1, 0.25, 0.4])
        chosen = choose(options, base_bits=3.0, max_bits=3.0 + budget)
        gain = sum(o.gain for o in options if chosen.get(o.layer) == o.bits)
        best = _best_by_search(options, budget)
        assert gain == pytest.approx(sum(o.gain for o in options if best.get(o.layer) == o.bits))
        assert sum(o.added_bits for o in options if chosen.get(o.layer) == o.bits) <= budget + 1e-9


def test_calibrate_measures_every_layer_and_fits_the_budget(seed):
    model = get_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    calibration, options = calibrate(model, ids, model_name="tiny-llama", bits="int2", candidates=("int8",),
                                     max_bits=12.0, chunk_size=16, window=16, progress=False)  # fmt: skip
    assert [(o.layer, o.bits) for o in options] == [(0, "int8"), (1, "int8"), (2, "int8")]
    measured = calibration.measured
    # int2 with the default groups: codes plus float16 scale and zero per group of 32 keys' tokens / values' channels
    assert measured["base_bits"] < 12.0 and calibration.bits_per_coordinate <= 12.0 + 1e-9
    assert all(o.added_bits > 0 for o in options)
    assert measured["base_kl"] > 0 and all(o.kl >= 0 for o in options)  # a divergence from full precision
    assert measured["calibrated_kl"] < measured["base_kl"]  # int8 layers diverge less than int2 ones
    full = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=16, progress=False).perplexity
    assert measured["dynamic_perplexity"] == pytest.approx(full, rel=1e-5)  # its chunked pass scores the same tokens
    assert set(calibration.layer_bits) == {o.layer for o in options if o.gain > 0}
    assert calibration.layer_bits and set(calibration.layer_bits.values()) == {"int8"}
    with pytest.raises(ConfigError, match="over max_bits=1.0"):
        calibrate(model, ids, model_name="tiny-llama", bits="int2", max_bits=1.0, chunk_size=16, window=16,
                  progress=False)  # fmt: skip


EVICTING_SPECS = ["sink:4:60:bits=int2:group=4", "h2o:64:bits=int2:group=4", "snapkv:64:bits=int2:group=4",
                  "peak:64:bits=int2:group=4", "kvzip:64:bits=int2:group=4"]  # fmt: skip


@pytest.mark.parametrize("spec", EVICTING_SPECS + ["kvzap:64:bits=int2:group=4"])
def test_evicting_slots_hold_a_layer_in_its_own_format(spec, config, tmp_path):
    path = Calibration("tiny", config.model_type, 3, "int2", {1: 8}, 9.0, 0.0).save(tmp_path / "c.json")
    if spec.startswith("kvzap"):  # (its surrogate, fitted on this model: random weights do here)
        spec += f":weights={random_surrogate(config).save(tmp_path / 's.safetensors')}"
    cache = parse_cache_spec(f"{spec}:calibration={path}").build(config)
    assert [layer.storage.codec.fmt.bits for layer in cache.layers] == [2, 8, 2]
    errors = _key_errors(cache, config, coded=40)  # (slots hold every token coded)
    assert errors[1] < errors[0] / 8 and errors[1] < errors[2] / 8, f"layer 1 is not held at 8 bits: {errors}"


def test_evicting_layer_bits_need_bits_and_known_layers(config, tmp_path):
    from hf_kvplus import H2OCache

    with pytest.raises(ConfigError, match="layer_bits=.* need bits"):
        H2OCache(config, budget=64, layer_bits={1: 8})
    with pytest.raises(ConfigError, match=r"names layers \[5\], but the model has 3"):
        H2OCache(config, budget=64, bits=2, layer_bits={5: 8})
    path = Calibration("tiny", config.model_type, 3, "int2", {1: 8}, 9.0, 0.0).save(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="calibration= .* needs bits="):
        parse_cache_spec(f"h2o:64:calibration={path}")
    with pytest.raises(ConfigError):  # a calibration of int2 for an int4 cache
        parse_cache_spec(f"h2o:64:bits=int4:calibration={path}")


def test_calibrate_counts_the_budget_at_budget_tokens_and_reuses_measured_options(seed):
    model = get_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    longer = torch.randint(0, model.config.vocab_size, (1, 192))
    args = dict(model_name="tiny-llama", bits="int2", max_bits=12.0, chunk_size=16, window=16, first_tokens=4,
                progress=False)  # fmt: skip
    short, _ = calibrate(model, ids, candidates=("int8",), **args)
    long, options = calibrate(model, ids, candidates=("int8", "int4"), budget_tokens=192, reuse=[short], **args)

    def held_bits(layer_bits):  # what the cache holds once it has seen 192 tokens
        cache = QuantizedCache(model.config, bits="int2", window=16, first_tokens=4, layer_bits=layer_bits)
        perplexity(model, longer, cache, chunk_size=16, progress=False)
        return cache.quantized_report()["bits_per_coordinate"]

    assert long.measured["budget_tokens"] == 192
    assert long.measured["base_bits"] == pytest.approx(held_bits({}), rel=1e-9)
    assert long.bits_per_coordinate == pytest.approx(held_bits(long.layer_bits), rel=1e-9)
    # 4 exact float32 tokens weigh less per coordinate in 192 tokens than in 96
    assert long.measured["base_bits"] < short.measured["base_bits"]
    reused = {(o["layer"], o["bits"]): o["kl"] for o in short.measured["options"]}
    assert {(o.layer, o.bits): o.kl for o in options if o.bits == "int8"} == reused  # taken, not measured again
    assert {o.bits for o in options} == {"int8", "int4"}
    with pytest.raises(ConfigError, match="measured otherwise"):
        calibrate(model, ids, candidates=("int8",), reuse=[short], **(args | {"chunk_size": 32}))
    # two rotation seeds: seed 0's options are taken from `short`, seed 1's measured, the divergences averaged
    both, options = calibrate(model, ids, candidates=("int8",), rotation_seed=[0, 1], reuse=[short], **args)
    for option, record in zip(options, both.measured["options"], strict=True):
        assert record["kl_by_seed"]["0"] == reused[option.layer, "int8"]
        assert option.kl == pytest.approx((record["kl_by_seed"]["0"] + record["kl_by_seed"]["1"]) / 2)
    assert both.measured["rotation_seed"] == [0, 1] and set(both.measured["base_kl_by_seed"]) == {"0", "1"}


def test_calibrate_counts_a_sliding_layers_bits_at_its_window():
    # The tiny Gemma 3's sliding layers keep 8 tokens: at 96 tokens the budget's bits are those the cache holds then
    # (its family's formats: the full layer's k3v2 alone past the window), not those of every layer holding all 96.
    model = get_model("gemma3")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    longer = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    args = dict(model_name="tiny-gemma3", bits="k2v2", max_bits=16.0, chunk_size=16, window=16, first_tokens=0,
                progress=False)  # fmt: skip
    calibration, _ = calibrate(model, ids, candidates=("k4v2",), budget_tokens=96, **args)
    cache = QuantizedCache(model.config, bits="k2v2", window=16, first_tokens=0)
    assert cache.family is not None  # (formats differing by layer kind: what a wrong count shows)
    perplexity(model, longer, cache, chunk_size=16, progress=False)
    assert calibration.measured["base_bits"] == pytest.approx(cache.quantized_report()["bits_per_coordinate"], rel=1e-9)
