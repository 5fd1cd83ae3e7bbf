"""Every cache pickles and deep-copies after use, and the copy continues with the same logits.

One spec per cache family the spec parser knows (`specs.CACHE_KINDS`), sized so that a 72-token prompt on the tiny
Llama fills and quantizes windows, evicts and offloads; each is copied after the prompt and again after decode steps,
and the copies and the original then decode the same tokens: their logits must be equal bit for bit. What cannot
travel (the disk tier's files, a pool shared with other caches) is refused with `UnsupportedOperationError`.
"""

import copy
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch

from conformance.models import get_model
from hf_kvplus import PagedCache, PagedPool, cache_kwargs
from hf_kvplus.errors import UnsupportedOperationError
from hf_kvplus.specs import CACHE_KINDS, parse_cache_spec

PROMPT, STEPS = 72, 3
#: The surrogate the kvzap spec names, written for the tiny Llama before the tests (`kvzap_weights`): one file a
#: process, named apart from the test ids (which must be the same in every pytest-xdist worker).
KVZAP_WEIGHTS = Path(tempfile.gettempdir()) / f"hf_kvplus_test_kvzap_{os.getpid()}.safetensors"

SPECS = [
    "dense", "dense:max_tokens=96:compile=on", "paged:block=8", "paged:max_tokens=96:compile=on",
    "quantized:int8:window=16", "quantized:int4:window=16", "quantized:int2:window=16", "quantized:fp8:window=16",
    "quantized:k4v2:window=16", "quantized:int4:window=16:first=4", "quantized:int4:window=16:boundary=1",
    "quantized:int4:window=16:max_tokens=96:compile=on", "quantized:k4v2:window=16:max_tokens=96:compile=on",
    "quantized:int4:window=16:backend=quanto", "paged-quantized:int4:window=16:block=16",
    "sink:4:28", "sink:4:28:bits=int4", "sink:4:28:compile=on", "h2o:32", "h2o:32:bits=int8", "h2o:32:compile=on",
    "snapkv:32:observation=8", "snapkv:32:observation=8:bits=int4", "peak:32", "peak:32:bits=int4", "kvzip:32",
    f"kvzap:32:weights={KVZAP_WEIGHTS}", f"kvzap:32:weights={KVZAP_WEIGHTS}:bits=int4:compress=always",
    "offloaded", "offloaded:lookahead=2", "offloaded-quantized:int4:window=16",
    "offloaded:disk=tmp:host=1G", "dynamic", "static:96",
]  # fmt: skip
#: Transformers' own caches that do not travel: its QuantizedCache holds optimum-quanto tensors that neither pickle
#: nor deep-copy (not hf_kvplus's to fix).
FOREIGN = ["hf-quantized:quanto:4"]


@pytest.fixture(scope="module", autouse=True)
def kvzap_weights():
    from test_kvzap import random_surrogate

    random_surrogate(get_model("llama").config).save(KVZAP_WEIGHTS)
    yield
    KVZAP_WEIGHTS.unlink(missing_ok=True)


def test_every_cache_family_is_covered():
    """Every family hf_kvplus defines (a policy registered from elsewhere, as the examples' are, is theirs to test)."""
    own = {name for name, kind in CACHE_KINDS.items() if kind.policy is None or kind.policy.__module__.startswith("hf_kvplus.")}
    assert {spec.split(":")[0] for spec in SPECS + FOREIGN} == own


def prompt_ids(n=PROMPT, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def step(model, cache, tokens):
    return model(tokens, **cache_kwargs(cache)).logits[:, -1]


def round_trips(cache):
    return {"pickle": pickle.loads(pickle.dumps(cache)), "deepcopy": copy.deepcopy(cache)}


def continue_all(model, caches: dict, steps: int, seed: int):
    """Decodes the same `steps` tokens through every cache; returns each one's logits per step."""
    tokens = torch.randint(3, 128, (steps, 1, 1), generator=torch.Generator().manual_seed(seed))
    return {name: [step(model, cache, t) for t in tokens] for name, cache in caches.items()}


def assert_same_logits(runs: dict, spec: str, when: str):
    want = runs.pop("original")
    for name, got in runs.items():
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), (
                f"{spec}: the {name} copy made {when} differs from the original at its step {i}: "
                f"max |diff| {(g - w).abs().max().item():.3g}"
            )


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.replace(str(KVZAP_WEIGHTS), "WEIGHTS"))
@torch.no_grad()
def test_copy_after_prompt_and_after_decode_continues_the_same(spec):
    model = get_model("llama")
    cache = parse_cache_spec(spec).build(model.config, max_length=96)
    step(model, cache, prompt_ids())
    runs = continue_all(model, {"original": cache, **round_trips(cache)}, STEPS, seed=1)
    assert_same_logits(runs, spec, "after the prompt")
    runs = continue_all(model, {"original": cache, **round_trips(cache)}, STEPS, seed=2)
    assert_same_logits(runs, spec, f"after {STEPS} decode steps")


@torch.no_grad()
def test_paged_cache_with_a_prefix_store_travels_with_it():
    model = get_model("llama")
    cache = PagedCache(model.config, block_size=8)
    ids = prompt_ids()
    cache.reuse_prefix(ids)  # tells the cache its prompt, which store_prefix stores
    step(model, cache, ids)
    assert cache.store_prefix(ids) == PROMPT // 8
    copies = round_trips(cache)
    runs = continue_all(model, {"original": cache, **copies}, STEPS, seed=3)
    assert_same_logits(runs, "paged with a prefix store", "after store_prefix")
    for name, copied in copies.items():  # the copy's own store serves its prefix
        fresh = PagedCache(model.config, pool=copied.pool)
        assert fresh.reuse_prefix(ids) == PROMPT - 8, name


@torch.no_grad()
def test_disk_tier_files_and_shared_pools_are_refused_by_name():
    model = get_model("llama")
    with tempfile.TemporaryDirectory() as folder:
        cache = parse_cache_spec(f"offloaded:disk={folder}:host=0").build(model.config)
        step(model, cache, prompt_ids())
        for how in (pickle.dumps, copy.deepcopy):
            with pytest.raises(UnsupportedOperationError, match=r"disk tier's files in .*host_budget=0"):
                how(cache)
        assert len(step(model, cache, prompt_ids(1))) == 1  # the original is still whole
        cache.close()
    pool = PagedPool(model.config, block_size=8)
    shared = PagedCache(model.config, pool=pool, namespace="tenant")
    step(model, shared, prompt_ids())
    for how in (pickle.dumps, copy.deepcopy):
        with pytest.raises(UnsupportedOperationError, match=r"shares a PagedPool \(9 blocks in use under namespace 'tenant'\)"):
            how(shared)
