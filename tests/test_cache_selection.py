"""Caches selected by name, the Transformers way: `cache_implementation="kvplus:<spec>"` in `generate`, in a saved
and loaded `generation_config.json`, and through `pipeline("text-generation")`; unknown specs refused clearly;
`uninstall()` gives Transformers back exactly what it had (the bit-identity of Transformers' own caches with the
plugin imported is test_plugin_isolation.py's)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, pipeline
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin
from word_model import save_word_model

import hf_kvplus
from hf_kvplus import ConfigError, QuantizedCache, SinkCache, cache_kwarg, cache_kwargs, selection

TEXT = " ".join(f"w{i}" for i in range(60))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("word-model")
    save_word_model(path, TEXT)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def prompt(batch=2, length=40):
    torch.manual_seed(1)
    return torch.randint(1, 60, (batch, length))


def generate(model, **kwargs):
    with torch.no_grad():
        return model.generate(prompt(), max_new_tokens=12, do_sample=False, **kwargs)


@pytest.mark.parametrize(
    ("name", "explicit"),
    [
        ("kvplus:quantized:int4:group=16:window=16", lambda c: QuantizedCache(c, bits=4, group_size=16, window=16)),
        ("kvplus:sink:4:20", lambda c: SinkCache(c, num_sinks=4, window=20)),
    ],
)
def test_a_name_in_generate_builds_that_cache(model, name, explicit):
    out = generate(model, cache_implementation=name, return_dict_in_generate=True)
    cache = getattr(out, cache_kwarg())
    assert type(cache) is type(explicit(model.config))
    assert torch.equal(out.sequences, generate(model, **cache_kwargs(explicit(model.config))))


def test_lossless_names_give_dynamic_tokens(model):
    want = generate(model)
    for name in ("kvplus:dense", "kvplus:paged:block=8", "kvplus:offloaded"):
        assert torch.equal(generate(model, cache_implementation=name), want), name


def test_a_saved_generation_config_names_the_cache(model, tmp_path):
    GenerationConfig(cache_implementation="kvplus:sink:4:20", do_sample=False).save_pretrained(tmp_path)
    assert '"kvplus:sink:4:20"' in (tmp_path / "generation_config.json").read_text()
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.cache_implementation == "kvplus:sink:4:20"
    with torch.no_grad():
        got = model.generate(prompt(), generation_config=loaded, max_new_tokens=12)
    assert torch.equal(got, generate(model, **cache_kwargs(SinkCache(model.config, num_sinks=4, window=20))))


def test_a_pipeline_passes_the_name_through(folder, model):
    pipe = pipeline("text-generation", model=model, tokenizer=str(folder))
    text = " ".join(f"w{i}" for i in range(30))
    kwargs = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    want = pipe(text, cache_implementation="kvplus:dense", **kwargs)[0]["generated_text"]
    assert want == pipe(text, **kwargs)[0]["generated_text"]
    sink = pipe(text, cache_implementation="kvplus:sink:2:8", **kwargs)[0]["generated_text"]
    explicit = pipe(text, **cache_kwargs(SinkCache(model.config, num_sinks=2, window=8)), **kwargs)[0]["generated_text"]
    assert sink == explicit


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("kvplus:nope", r"cache_implementation='kvplus:nope': unknown cache 'nope'.*known: \['dense'"),
        ("kvplus:quantized:int3", "kvplus:quantized:int3"),
        ("kvplus:", "non-empty"),
    ],
)
def test_unknown_specs_are_refused_naming_the_accepted_ones(model, name, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig(cache_implementation=name)
    with pytest.raises(ConfigError, match=match):
        generate(model, cache_implementation=name)


def test_uninstall_gives_transformers_back_what_it_had(model):
    names, prepare = configuration_utils.ALL_CACHE_IMPLEMENTATIONS, GenerationMixin._prepare_cache_for_generation
    try:
        hf_kvplus.uninstall()
        assert type(configuration_utils.ALL_CACHE_IMPLEMENTATIONS) is tuple
        assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS == names
        assert GenerationMixin._prepare_cache_for_generation is prepare.__wrapped__
        with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
            GenerationConfig(cache_implementation="kvplus:dense")
        hf_kvplus.uninstall()  # idempotent
    finally:
        hf_kvplus.install()
        hf_kvplus.install()  # idempotent: wrapped once
    assert GenerationMixin._prepare_cache_for_generation.__wrapped__ is prepare.__wrapped__
    assert isinstance(configuration_utils.ALL_CACHE_IMPLEMENTATIONS, selection.CacheNames)
    with pytest.raises(ValueError, match="Invalid `cache_implementation`"):  # Transformers' own refusal stays
        GenerationConfig(cache_implementation="bogus")
    assert torch.equal(generate(model, cache_implementation="static"), generate(model))
