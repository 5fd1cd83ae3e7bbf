"""The cache keyword: `cache_kwarg()` names what the installed Transformers' forwards and `generate` take (and
their outputs hold), and the project's own paths (perplexity, the benchmark loop, a `generate` through
`cache_kwargs`) run without the FutureWarning Transformers 5.24 gives the old name `past_key_values`."""

from __future__ import annotations

import inspect
import os
import warnings

import torch
import transformers
from transformers import DynamicCache, LlamaForCausalLM

from conformance.models import get_model
from hf_kvplus import DenseCache, cache_kwarg, cache_kwargs
from hf_kvplus.evaluation import perplexity
from hf_kvplus.evaluation.benchmark import run_once
from hf_kvplus.specs import parse_cache_spec


def test_the_expected_transformers_is_imported():
    """scripts/test.sh runs this file and the conformance tests again on the lowest supported Transformers, put first
    on PYTHONPATH, with KVPLUS_EXPECT_TRANSFORMERS set to its version: that run must not test the venv's newest."""
    expected = os.environ.get("KVPLUS_EXPECT_TRANSFORMERS")
    if expected:
        assert transformers.__version__.startswith(f"{expected}."), (transformers.__version__, transformers.__file__)


def test_the_name_is_the_one_model_forwards_take():
    assert cache_kwarg() in ("cache", "past_key_values")
    assert cache_kwarg() in inspect.signature(LlamaForCausalLM.forward).parameters
    cache = DenseCache(config=get_model("llama").config)
    assert cache_kwargs(cache) == {cache_kwarg(): cache}


def test_the_project_paths_pass_the_cache_without_a_deprecation_warning():
    model = get_model("llama")
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (1, 24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        perplexity(model, ids, lambda: DenseCache(config=model.config), chunk_size=8, progress=False)
        run_once(model, parse_cache_spec("dense"), ids[:, :16], new_tokens=3, prefill_chunk=8)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                 **cache_kwargs(DynamicCache(config=model.config)))  # fmt: skip
    assert isinstance(getattr(out, cache_kwarg()), DynamicCache)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not [m for m in deprecations if "past_key_values" in m], deprecations
