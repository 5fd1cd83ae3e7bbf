"""Layers rotated with a seed of their own (`layer_rotations`: `PrecisionRegions`, `QuantizedCache`,
`OffloadedCache`, `Calibration`) and the calibration that chooses them (`calibrate(rotations=N)`,
`kvplus calibrate --rotations N`)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from conformance.models import get_model
from hf_kvplus import ConfigError, OffloadedCache, QuantizedCache, load_cache
from hf_kvplus.calibration import Calibration
from hf_kvplus.evaluation.calibrate import ROTATION_STRIDE, calibrate, chunked_pass
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.transformers_compat import cache_kwargs


@pytest.fixture
def config():
    config = get_model("llama").config
    assert config.num_hidden_layers == 3
    return config


def seeds(cache) -> list[int | None]:
    """Each layer's rotation seed (None: a format without one)."""
    return [getattr(layer.storage.formats()[0], "seed", None) for layer in cache.layers]


def test_a_layer_rotates_with_its_own_seed_and_the_others_with_theirs(config):
    assert seeds(QuantizedCache(config, bits="k4v2", rotation_seed=3, first_tokens=0)) == [3, 4, 5]
    cache = QuantizedCache(config, bits="k4v2", rotation_seed=3, first_tokens=0, layer_rotations={1: 1001})
    assert seeds(cache) == [3, 1001, 5]
    offloaded = OffloadedCache(config, bits="k4v2", rotation_seed=3, layer_rotations={2: 77})
    assert seeds(offloaded) == [3, 4, 77]


def test_the_seed_changes_the_codes_of_that_layer_alone(config):
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = torch.randn(1, heads, 40, dim), torch.randn(1, heads, 40, dim)

    def read(layer_rotations):
        cache = QuantizedCache(config, bits="k2v2", window=8, first_tokens=0, layer_rotations=layer_rotations)
        return [_update(cache, i, k, v) for i in range(3)]

    plain, turned = read(None), read({1: 1001})
    assert torch.equal(plain[0], turned[0]) and torch.equal(plain[2], turned[2])
    assert not torch.equal(plain[1], turned[1])  # another rotation: other codes, another error


def _update(cache, index, k, v):
    """The keys layer `index` holds (the coded ones decoded) once it took `k`/`v`."""
    cache.update(k, v, index)
    keys, _ = cache.layers[index].storage.view(k.shape[2])
    return keys.clone()


def test_bad_layer_rotations_are_refused(config):
    with pytest.raises(ConfigError, match=r"layer_rotations names layers \[3\], but the model has 3"):
        QuantizedCache(config, bits="k4v2", layer_rotations={3: 1})
    with pytest.raises(ConfigError, match="layer 1 rotation seed 5, but it holds 4: only a rotated format"):
        QuantizedCache(config, bits="k4v2", layer_bits={1: 4}, layer_rotations={1: 5})
    with pytest.raises(ConfigError, match="holds full precision"):
        QuantizedCache(config, bits="k4v2", layer_bits={1: None}, layer_rotations={1: 5})
    with pytest.raises(ConfigError, match="seed 'a'"):
        QuantizedCache(config, bits="k4v2", layer_rotations={1: "a"})
    with pytest.raises(ConfigError, match="layer indices"):
        QuantizedCache(config, bits="k4v2", layer_rotations={-1: 5})


def test_a_calibrations_rotations_round_trip_and_reach_the_caches_that_take_them(config, tmp_path):
    calibration = Calibration("tiny", config.model_type, 3, "k4v2", {0: "k4v3"}, 3.5, 3.4, {"text": "t"}, {0: 1000, 2: 7})
    path = calibration.save(tmp_path / "c.json")
    assert json.loads(path.read_text())["layer_rotations"] == {"0": 1000, "2": 7}
    assert Calibration.load(path) == calibration
    older = json.loads(path.read_text())
    del older["layer_rotations"]  # a file written before calibrations chose rotations
    (tmp_path / "old.json").write_text(json.dumps(older))
    assert Calibration.load(tmp_path / "old.json").layer_rotations == {}

    assert seeds(QuantizedCache(config, bits="k4v2", first_tokens=0, calibration=calibration)) == [1000, 1, 7]
    for spec in (f"quantized:k4v2:first=0:calibration={path}", f"offloaded-quantized:k4v2:calibration={path}"):
        assert seeds(parse_cache_spec(spec).build(config)) == [1000, 1, 7], spec
    for spec, cache in ((f"paged-quantized:k4v2:calibration={path}", "a paged cache"),
                        (f"h2o:64:bits=k4v2:calibration={path}", "an evicting cache")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"rotates layers \[0, 2\] with seeds of their own, which {cache}"):
            parse_cache_spec(spec).build(config)
    with pytest.raises(ConfigError, match="give layer_rotations .* or calibration"):
        QuantizedCache(config, bits="k4v2", calibration=calibration, layer_rotations={1: 3})
    with pytest.raises(ConfigError, match="rotates layer 1 with seed 5: .* got 4"):
        Calibration("tiny", config.model_type, 3, "k4v2", {1: 4}, 3.5, 3.4, {}, {1: 5})
    with pytest.raises(ConfigError, match="rotates layer 4"):
        Calibration("tiny", config.model_type, 3, "k4v2", {}, 3.5, 3.4, {}, {4: 5})


def test_a_saved_cache_keeps_its_layers_rotations(config, tmp_path):
    model = get_model("llama")
    cache = QuantizedCache(model.config, bits="k2v2", window=8, first_tokens=0, layer_rotations={1: 1001})
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        cache.save(tmp_path / "cache.safetensors")
        loaded = load_cache(tmp_path / "cache.safetensors", model.config)
        assert seeds(loaded) == [0, 1001, 2]
        token = torch.tensor([[5]])
        want = model(token, **cache_kwargs(cache)).logits
        assert torch.equal(model(token, **cache_kwargs(loaded)).logits, want)


def test_calibrate_keeps_each_full_layers_rotation_of_least_divergence():
    model = get_model("gemma3")  # layer 2 full attention, the others sliding (8 tokens)
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    args = dict(model_name="tiny-gemma3", bits="k2v2", candidates=("k4v2",), max_bits=16.0, chunk_size=16, window=16,
                progress=False)  # fmt: skip
    calibration, _ = calibrate(model, ids, rotations=4, **args)
    kls = calibration.measured["rotation_kl"]
    assert list(kls) == ["2"]  # the full layer alone: the sliding layers keep their seeds
    assert set(kls["2"]) == {"own", *(str(2 + ROTATION_STRIDE * j) for j in (1, 2, 3))}
    best = min(kls["2"], key=kls["2"].get)
    assert calibration.layer_rotations == ({} if best == "own" else {2: int(best)})
    assert len(set(kls["2"].values())) == 4  # each rotation codes the keys and values otherwise

    # the calibration's divergence is that of a cache built from it: its rotations are taken
    reference: list[torch.Tensor] = []
    chunked_pass(model, ids, DynamicCache(config=model.config), 16, reference)
    built = QuantizedCache(model.config, bits="k2v2", window=16, calibration=calibration)
    assert chunked_pass(model, ids, built, 16, reference)[1] == pytest.approx(calibration.measured["calibrated_kl"])
    assert calibration.measured["calibrated_kl"] == pytest.approx(kls["2"][best])

    plain, _ = calibrate(model, ids, **args)
    assert plain.layer_rotations == {} and plain.measured["rotation_kl"] == {}
    with pytest.raises(ConfigError, match="rotations .* must be an int >= 1, got 0"):
        calibrate(model, ids, rotations=0, **args)
