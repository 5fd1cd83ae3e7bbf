"""Per-family defaults of the rotated presets (`precision.FAMILY_DEFAULTS`): each applies to the family it names and
no other, only where no layer formats were asked for, and the cache holds and reports what it chose."""

import pytest
import torch
from transformers import Gemma3Config, Gemma3TextConfig

from conformance.models import ARCHITECTURES, build_model, make_config
from hf_kvplus import QuantizedCache
from hf_kvplus.calibration import Calibration
from hf_kvplus.model_spec import ModelSpec
from hf_kvplus.precision import FAMILY_DEFAULTS, PrecisionRegions, family_of, family_regions
from hf_kvplus.quantized_cache import quantized_storage
from hf_kvplus.transformers_compat import cache_kwargs

GEMMA = FAMILY_DEFAULTS[0]


def full_layers(config) -> list[int]:
    return [layer.index for layer in ModelSpec.from_config(config).layers if layer.kind == "full"]


def layer_format(cache, index: int) -> str:
    return str(cache.layers[index].storage.segment.fmt)


def test_gemma3_is_the_family_named():
    assert GEMMA.family == "Gemma 3"
    assert family_of(make_config("gemma3")) is GEMMA


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "gemma3"])
def test_no_other_family_of_the_sweep_takes_them(arch):
    config = make_config(arch)
    assert family_of(config) is None
    for bits in ("k2v2", "k3v2", "k4v2"):
        cache = QuantizedCache(config, bits=bits)
        assert cache.regions.layer_bits == ()
        assert cache.family is None
        assert cache.quantized_report()["family_defaults"] is None
        assert cache.regions.sliding_sinks is None and cache.regions.full_sinks is None
        assert all(getattr(getattr(layer, "storage", None), "sinks", 0) == 0 for layer in cache.layers)


def test_the_multimodal_gemma3_config_is_gemma3_too():
    text = make_config("gemma3")
    assert family_of(Gemma3Config(text_config=text.to_dict())) is GEMMA


@pytest.mark.parametrize("bits", sorted(GEMMA.kind_bits))
def test_gemma3_full_layers_take_the_family_format(bits):
    config = make_config("gemma3")
    cache = QuantizedCache(config, bits=bits)
    kinds = {layer.index: layer.kind for layer in ModelSpec.from_config(config).layers}
    wanted = {index: GEMMA.kind_bits[bits].get(kind, bits) for index, kind in kinds.items()}
    assert "full" in kinds.values() and wanted[full_layers(config)[0]] != bits
    assert dict(cache.regions.layer_bits) == {index: b for index, b in wanted.items() if b != bits}
    assert cache.family is GEMMA and cache.quantized_report()["family_defaults"] == "Gemma 3"
    for index in kinds:
        assert layer_format(cache, index) == wanted[index]


def test_gemma3_defaults_off_and_outside_the_presets():
    config = make_config("gemma3")
    assert QuantizedCache(config, bits="k2v2", family_defaults=False).regions.layer_bits == ()
    for bits in (4, 2, "k4v4", "k2v3"):  # a KIVI format, or a rotated format the family names no formats for
        assert QuantizedCache(config, bits=bits).regions.layer_bits == ()


def test_gemma3_defaults_give_way_to_what_is_asked(tmp_path):
    config = make_config("gemma3")
    assert dict(QuantizedCache(config, bits="k2v2", layer_bits={0: "k4v2"}).regions.layer_bits) == {0: "k4v2"}
    bounded = QuantizedCache(config, bits="k2v2", boundary_layers=1)
    assert bounded.regions.layer_bits == ()
    calibration = Calibration("tiny", "gemma3_text", 4, "k2v2", {1: "k3v2"}, 2.5, 2.4)
    calibrated = QuantizedCache(config, bits="k2v2", calibration=calibration)
    assert dict(calibrated.regions.layer_bits) == {1: "k3v2"}
    # the sinks are not layer formats: they stay, unless asked otherwise
    assert bounded.regions.sliding_sinks == calibrated.regions.sliding_sinks == GEMMA.sliding_sinks["k2v2"]
    assert bounded.regions.full_sinks == calibrated.regions.full_sinks == GEMMA.full_sinks["k2v2"]
    assert bounded.family is calibrated.family is GEMMA
    some = QuantizedCache(config, bits="k2v2", boundary_layers=1, sliding_sinks=0)
    assert some.regions.sliding_sinks == 0 and some.regions.full_sinks == GEMMA.full_sinks["k2v2"]
    assert some.family is GEMMA
    asked = QuantizedCache(config, bits="k2v2", boundary_layers=1, sliding_sinks=0, full_sinks=0)
    assert asked.regions.sliding_sinks == asked.regions.full_sinks == 0 and asked.family is None


def test_storage_factories_take_them_too():
    """Caches built on `quantized_storage` (offloaded, evicting with bits) get the family's formats."""
    config = make_config("gemma3")
    full = full_layers(config)[0]
    spec = ModelSpec.from_config(config).layers[full]
    assert str(quantized_storage(config, bits="k2v2")(spec).segment.fmt) == GEMMA.kind_bits["k2v2"]["full"]
    assert str(quantized_storage(config, bits="k2v2", family_defaults=False)(spec).segment.fmt) == "k2v2"
    regions = PrecisionRegions(layer_bits={full: None})
    assert family_regions(config, "k2v2", regions).layer_bits == regions.layer_bits  # (the sinks are not formats)


def test_gemma3_cache_runs_and_counts_the_family_bits():
    """A forward through the tiny Gemma 3 with k2v2: its layers are coded in the family's formats, and the bits per
    coordinate count them."""
    model = build_model("gemma3")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    caches = {on: QuantizedCache(model.config, bits="k2v2", window=8, family_defaults=on) for on in (True, False)}
    for cache in caches.values():
        with torch.inference_mode():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    bits = {on: cache.quantized_report()["bits_per_coordinate"] for on, cache in caches.items()}
    assert bits[True] > bits[False]  # k3v2 on full layers (2.5 bits against 2), sinks' copies on sliding ones


def test_gemma3_config_without_sliding_layers_is_still_gemma3():
    config = Gemma3TextConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              hidden_size=64, intermediate_size=64, vocab_size=64,
                              layer_types=["full_attention", "full_attention"])  # fmt: skip
    cache = QuantizedCache(config, bits="k2v2")
    full = GEMMA.kind_bits["k2v2"]["full"]
    assert full != "k2v2" and dict(cache.regions.layer_bits) == {0: full, 1: full}


def test_calibrate_starts_from_the_family_formats():
    """`calibrate` measures each option from the cache as the preset builds it: on Gemma 3 its family's layer formats,
    which the calibration then holds with the chosen ones (applying it, which turns the family defaults off, gives the
    same cache); `family_defaults=False`: from the preset's format on every layer."""
    from hf_kvplus.evaluation.calibrate import calibrate

    model = build_model("gemma3")
    ids = torch.randint(3, 128, (48,), generator=torch.Generator().manual_seed(0))
    family = dict(QuantizedCache(model.config, bits="k2v2").regions.layer_bits)
    args = {"model_name": "tiny-gemma3", "bits": "k2v2", "max_bits": 16.0, "chunk_size": 16, "window": 16,
            "progress": False}  # fmt: skip
    candidate = GEMMA.kind_bits["k2v2"]["full"]
    calibration, options = calibrate(model, ids, candidates=(candidate,), **args)
    full = full_layers(model.config)
    assert {o.layer for o in options}.isdisjoint(full)  # the candidate is already their format: nothing to measure
    assert all(calibration.layer_bits[index] == family[index] for index in family if index not in
               {o.layer for o in options})  # fmt: skip
    assert calibration.measured["family_layer_bits"] == family
    plain, options = calibrate(model, ids, candidates=(candidate,), family_defaults=False, **args)
    assert set(full) <= {o.layer for o in options} and plain.measured["family_layer_bits"] == {}


def test_check_format_measures_the_format_as_it_ships_on_the_model_at_hand():
    from hf_kvplus.evaluation.format_check import check_format

    model = build_model("gemma3")
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(0))
    strict = check_format(model, ids, "k2v2", threshold_pct=-100.0, window=8)
    assert strict.family_defaults == "Gemma 3" and strict.tokens == 40 and strict.bits_per_coordinate > 2
    assert strict.over and "over the -100% threshold" in strict.message()
    lenient = check_format(model, ids, "k2v2", threshold_pct=1e9, window=8)
    assert not lenient.over and lenient.delta_pct == strict.delta_pct
    assert check_format(model, ids, "k2v2", window=8, family_defaults=False).family_defaults is None


def test_calibrate_counts_the_family_sinks_in_its_budget():
    """The calibration measures and counts the bits of the cache that takes it: on Gemma 3 with its sliding layers'
    sinks (the family's, recorded), so the bits it reports are what `QuantizedCache(calibration=...)` holds after the
    same chunks, not the bits without the sinks' copies."""
    from hf_kvplus.evaluation.calibrate import calibrate

    model = build_model("gemma3")
    ids = torch.randint(3, 128, (48,), generator=torch.Generator().manual_seed(0))
    calibration, _ = calibrate(model, ids, model_name="tiny-gemma3", bits="k2v2", candidates=("k2v3",),
                               max_bits=16.0, chunk_size=8, window=4, progress=False)  # fmt: skip
    assert calibration.measured["sliding_sinks"] == GEMMA.sliding_sinks["k2v2"] > 0
    assert calibration.measured["full_sinks"] == GEMMA.full_sinks["k2v2"] > 0

    def held(**options) -> float:
        cache = QuantizedCache(model.config, bits="k2v2", window=4, calibration=calibration, **options)
        with torch.inference_mode():
            for start in range(0, ids.numel(), 8):
                model(input_ids=ids[None, start:start + 8], **cache_kwargs(cache), use_cache=True)
        return cache.quantized_report()["bits_per_coordinate"]

    assert calibration.bits_per_coordinate == pytest.approx(held(), rel=1e-6)
    assert held(sliding_sinks=0) < calibration.bits_per_coordinate  # (the sinks' copies are in what it counted)
    assert held(full_sinks=0) != calibration.bits_per_coordinate  # (the full layers' copies, not their first tokens)


def test_calibrate_with_first_tokens_asked_keeps_them_not_the_family_sinks():
    """`--first N` on Gemma 3: the full layers keep their first tokens, as `QuantizedCache(first_tokens=N)` then holds
    them (the family's full-layer sinks would take their place); recorded as no full-layer sinks."""
    from hf_kvplus.evaluation.calibrate import calibrate

    model = build_model("gemma3")
    ids = torch.randint(3, 128, (32,), generator=torch.Generator().manual_seed(1))
    calibration, _ = calibrate(model, ids, model_name="tiny-gemma3", bits="k2v2", candidates=("k2v3",), max_bits=16.0,
                               chunk_size=8, window=4, first_tokens=2, progress=False)  # fmt: skip
    assert calibration.measured["full_sinks"] == 0 and calibration.measured["first_tokens"] == 2
    assert calibration.measured["sliding_sinks"] == GEMMA.sliding_sinks["k2v2"]
