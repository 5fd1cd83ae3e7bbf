"""Artifacts fitted to a model (`fitted`): KVzap surrogates and low-bit calibrations found from the model's config,
in the user cache folder before the package data; a model with none gets `ArtifactNotFoundError` saying the command,
its measured cost and where it writes; an artifact for another model is refused naming both; the commands write where
the lookup looks; the shipped SmolLM2-135M and Gemma 3 270M artifacts load and run in `generate()` on those models."""

import json

import pytest
import torch
from test_kvzap import random_surrogate

from conformance.models import get_model
from hf_kvplus import (
    ArtifactNotFoundError,
    CacheMismatchError,
    Calibration,
    ConfigError,
    KVzapCache,
    QuantizedCache,
    Surrogate,
    cache_kwargs,
    fitted,
)
from hf_kvplus.specs import parse_cache_spec


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """An empty user cache folder, and package data of our own (empty) unless a test fills it."""
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fitted, "PACKAGED", tmp_path / "packaged")
    return tmp_path


def put_surrogate(root, config, seed: int) -> Surrogate:
    surrogate = random_surrogate(config, seed)
    folder = root / fitted.model_key(config) / "kvzap"
    folder.mkdir(parents=True)
    surrogate.save(folder / "surrogate.safetensors")
    return surrogate


def test_a_model_without_one_is_told_the_command_its_cost_and_where_it_writes(user_cache):
    config = get_model("llama").config
    where = user_cache / "cache" / "fitted" / fitted.model_key(config)
    with pytest.raises(ArtifactNotFoundError) as error:
        KVzapCache(config, budget=0.2)
    text = str(error.value)
    assert "kvplus train-surrogate --model" in text and f"writes it to {where / 'kvzap'}" in text
    assert "Measured cost: Gemma 3 270M" in text and " min" in text and "12,288 tokens" in text
    with pytest.raises(ArtifactNotFoundError, match=r"kvplus calibrate --model .* --bits k4v2 .* writes it to "
                                                    + str(where / "calibration" / "k4v2").replace(".", r"\.")):
        QuantizedCache(config, bits="k4v2", calibration="auto")
    with pytest.raises(ArtifactNotFoundError):
        parse_cache_spec("kvzap:20%").build(config)


def test_the_user_folder_comes_before_the_package_data(user_cache):
    config = get_model("llama").config
    packaged = put_surrogate(user_cache / "packaged", config, seed=1)
    assert torch.equal(KVzapCache(config, budget=0.5).surrogate.weights, packaged.weights)
    mine = put_surrogate(user_cache / "cache" / "fitted", config, seed=2)
    assert not torch.equal(mine.weights, packaged.weights)
    assert torch.equal(KVzapCache(config, budget=0.5).surrogate.weights, mine.weights)
    assert torch.equal(parse_cache_spec("kvzap:50%").build(config).surrogate.weights, mine.weights)
    assert fitted.find(config, "kvzap", "surrogate.safetensors").is_relative_to(user_cache / "cache")


def test_an_artifact_for_another_model_is_refused_naming_both(user_cache):
    llama, gemma = get_model("llama").config, get_model("gemma3").config
    folder = user_cache / "cache" / "fitted" / fitted.model_key(gemma) / "kvzap"
    folder.mkdir(parents=True)
    random_surrogate(llama).save(folder / "surrogate.safetensors")  # a llama's file where gemma's should be
    with pytest.raises(CacheMismatchError, match=r"the surrogate is for tiny \(llama, 3 layers .*\); .* is gemma3_text"):
        KVzapCache(gemma, budget=0.5)
    shipped = fitted.PACKAGED.parent / "shipped"
    real = next(p for p in (fitted.Path(fitted.__file__).parent / "data" / "fitted").glob("*/calibration/k4v2/*"))
    with pytest.raises(CacheMismatchError, match=r"the calibration is for smollm2-135m \(llama, 30 layers\); .* is "
                                                 r"llama with 3 layers"):
        QuantizedCache(llama, bits="k4v2", calibration=real)
    with pytest.raises(ConfigError, match=r"chose layers for bits='k4v2'; the cache asks for bits='k3v2'"):
        QuantizedCache(llama, bits="k3v2", calibration=Calibration("tiny", "llama", 3, "k4v2", {1: "k4v3"}, 3.5, 3.4))
    assert not shipped.exists()


def test_calibration_and_layer_bits_are_one_or_the_other(user_cache):
    config = get_model("llama").config
    with pytest.raises(ConfigError, match=r"give layer_bits \(\{0: 'k4v3'\}\) or calibration"):
        QuantizedCache(config, bits="k4v2", layer_bits={0: "k4v3"}, calibration="auto")


def fake_run(module, monkeypatch, model):
    """`module.run`'s model and measurement replaced by the tiny model and a stub, so only where it writes is run."""
    from hf_kvplus.cli import common

    monkeypatch.setattr(common, "load", lambda args, text=True: (model, None, "text"))
    monkeypatch.setattr(common, "scored_tokens", lambda tokenizer, text, tokens: torch.zeros(tokens, dtype=torch.long))


def test_the_commands_write_where_the_lookup_finds_them(user_cache, monkeypatch):
    from hf_kvplus.cli import calibrate as cli_calibrate
    from hf_kvplus.cli import surrogate as cli_surrogate

    model = get_model("llama")
    surrogate = random_surrogate(model.config, seed=3)
    monkeypatch.setattr("hf_kvplus.resolve.load_model", lambda name: (model, None))
    monkeypatch.setattr("hf_kvplus.resolve.load_text", lambda name: "text")
    monkeypatch.setattr(cli_surrogate.common, "tokenize", lambda tok, text, n: torch.arange(5000))
    monkeypatch.setattr(cli_surrogate, "with_numbers", lambda *a: torch.zeros(1, 2048, dtype=torch.long))
    monkeypatch.setattr(cli_surrogate, "fit_surrogate", lambda *a, **k: surrogate)
    monkeypatch.setattr(cli_surrogate, "ranking_quality", lambda *a, **k: {"spearman": 1.0, "recall": 1.0, "keep": 0.2,
                                                                           "worst_layer_spearman": 1.0,
                                                                           "worst_layer_recall": 1.0})  # fmt: skip
    parser = cli_parser()
    args = parser.parse_args(["train-surrogate", "--model", "tiny"])
    assert args.func(args) == 0
    assert torch.equal(KVzapCache(model.config, budget=0.5).surrogate.weights, surrogate.weights)

    calibration = Calibration("tiny", "llama", 3, "k4v2", {1: "k4v3"}, 3.5, 3.4)
    fake_run(cli_calibrate, monkeypatch, model)
    monkeypatch.setattr(cli_calibrate, "calibrate", lambda *a, **k: (calibration, []))
    monkeypatch.setattr(cli_calibrate, "_plot", lambda *a: None)
    calibration.measured.update({"base_delta_pct": 0.0, "base_kl": 0.0, "base_bits": 3.3, "calibrated_delta_pct": 0.0,
                                 "calibrated_kl": 0.0, "budget_tokens": 64})  # fmt: skip
    args = parser.parse_args(["calibrate", "--model", "tiny", "--tokens", "64"])
    assert args.func(args) == 0
    cache = QuantizedCache(model.config, bits="k4v2", calibration="auto")
    assert dict(cache.regions.layer_bits) == {1: "k4v3"}
    assert dict(parse_cache_spec("quantized:k4v2:calibration=auto").build(model.config).regions.layer_bits) == {
        1: "k4v3"}


def cli_parser():
    from hf_kvplus.cli import build_parser

    return build_parser()


SMOLLM2 = "llama-l30-kv3-d64-h576-v49152"
GEMMA3 = "gemma3_text-l18-kv1-d256-h640-v262144"


def test_the_package_ships_both_models_artifacts():
    assert fitted.shipped() == [f"{GEMMA3}/calibration/k3v2", f"{GEMMA3}/calibration/k4v2", f"{GEMMA3}/key_scale", f"{GEMMA3}/kvzap",
                                f"{SMOLLM2}/calibration/k2v2",
                                f"{SMOLLM2}/calibration/k3v2", f"{SMOLLM2}/calibration/k4v2", f"{SMOLLM2}/kvzap"]
    assert set(fitted.PACKAGED_MODELS) == {SMOLLM2, GEMMA3}


@pytest.mark.parametrize("bits", ["k3v2", "k4v2"])
def test_gemma3s_calibrations_are_found_for_it_and_for_no_other_model(bits, monkeypatch, tmp_path):
    """`calibration="auto"` on Gemma 3 270M's config (an empty user folder) finds the package's k3v2 and k4v2
    calibrations, measured with its key scale, and takes their layer formats; Gemma 3 4B, the same family with another
    model key, finds none. (No k2v2 calibration ships for it: measured with the scale, it did worse than the family's
    formats.)"""
    from hf_kvplus.planning.configs import load_config

    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path))
    gemma = load_config("gemma3-270m")
    path = fitted.find(gemma, f"calibration/{bits}", "calibration.json")
    assert path == fitted.PACKAGED / GEMMA3 / "calibration" / bits / "calibration.json"
    shipped = json.loads(path.read_text())
    assert (shipped["model"], shipped["model_type"], shipped["bits"]) == ("gemma3-270m", "gemma3_text", bits)
    assert shipped["measured"]["key_scale_digest"] == fitted.key_scale_for(gemma).digest()
    cache = QuantizedCache(gemma, bits=bits, calibration="auto")
    assert dict(cache.regions.layer_bits) == {int(k): v for k, v in shipped["layer_bits"].items()}
    assert dict(parse_cache_spec(f"quantized:{bits}:calibration=auto").build(gemma).regions.layer_bits) == dict(
        cache.regions.layer_bits)
    other = load_config("gemma3-4b")
    assert fitted.find(other, f"calibration/{bits}", "calibration.json") is None
    with pytest.raises(ArtifactNotFoundError, match=f"--bits {bits}"):
        QuantizedCache(other, bits=bits, calibration="auto")


@pytest.mark.parametrize("name, key", [("smollm2-135m", SMOLLM2), ("gemma3-270m", GEMMA3)])
def test_the_shipped_artifacts_load_and_run_on_the_embedded_models(name, key, monkeypatch, tmp_path):
    """The real model: `KVzapCache(config, budget=0.2)` and `calibration="auto"` find the package's files (an empty
    user folder), keep a fifth of the prompt's tokens per full-attention layer on average, and generate."""
    from hf_kvplus.resolve import load_model

    model, tokenizer = load_model(name)
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path))  # (after loading: the model stays where it is)
    assert fitted.model_key(model.config) == key
    ids = tokenizer("It is a truth universally acknowledged, " * 60, return_tensors="pt")["input_ids"][:, :300]
    cache = KVzapCache(model.config, budget=0.2)
    assert cache.surrogate.model == name
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 304 and cache.budget_tokens == 60
    full = [layer for layer in cache.layers if not layer.is_sliding]
    appended = cache.get_seq_length() - 300  # (decode steps append: compress="prefill")
    assert abs(sum(layer.storage.held - appended for layer in full) / len(full) - 60) <= 2  # the mean over layers
    expected = json.loads((fitted.PACKAGED / key / "calibration" / "k4v2" / "calibration.json").read_text())
    cache = QuantizedCache(model.config, bits="k4v2", calibration="auto")
    assert dict(cache.regions.layer_bits) == {int(k): v for k, v in expected["layer_bits"].items()}
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 304 and cache.quantized_report()["bits_per_coordinate"] > 3.0


def test_a_calibration_is_refused_by_a_cache_whose_keys_are_scaled_otherwise(tmp_path):
    """Which layers pay for more bits depends on the key scale the layers were measured with: Gemma 3 270M's caches
    take its shipped scale, so a calibration measured without one (or with another) is refused, naming both, and one
    measured with it loads; `key_scale="off"` takes the one measured without."""
    from hf_kvplus.planning.configs import load_config

    gemma = load_config("gemma3-270m")
    scale = fitted.key_scale_for(gemma)
    assert scale is not None
    layers = {index: "k4v3" for index in (1, 3)}
    without = Calibration("gemma3-270m", "gemma3_text", 18, "k4v2", layers, 3.5, 3.45, {"key_scale": None})
    with pytest.raises(ConfigError, match=r"measured with no key scale; this cache codes keys with key scale "
                                          r"gemma3-270m \(" + scale.digest()):
        QuantizedCache(gemma, bits="k4v2", calibration=without)
    with pytest.raises(ConfigError, match="measured with no key scale"):
        parse_cache_spec(f"quantized:k4v2:calibration={without.save(tmp_path / 'without.json')}").build(gemma)
    assert dict(QuantizedCache(gemma, bits="k4v2", calibration=without, key_scale="off").regions.layer_bits) == layers
    measured = {"key_scale": "gemma3-270m", "key_scale_digest": scale.digest()}
    scaled = Calibration("gemma3-270m", "gemma3_text", 18, "k4v2", layers, 3.5, 3.45, measured)
    assert dict(QuantizedCache(gemma, bits="k4v2", calibration=scaled).regions.layer_bits) == layers
    with pytest.raises(ConfigError, match=r"measured with key scale gemma3-270m .*; this cache codes keys with no key"):
        QuantizedCache(gemma, bits="k4v2", calibration=scaled, key_scale="off")
