"""Knorm from outside the package: registered by importing `knorm`, it keeps exactly the lowest-norm keys of each KV
head (a hand computation on the model's own keys), evicts to its budget in `generate()` on every slot format, and
compiles."""

import knorm
import policy_checks as checks
import pytest

from hf_kvplus import EvictingCache
from hf_kvplus.specs import parse_cache_spec


def test_it_registers_under_its_spec_name(model):
    cache = EvictingCache(model.config, "knorm", budget=10, recent=2)
    assert type(cache.layers[0].retention) is knorm.KnormPolicy
    assert repr(parse_cache_spec("knorm:10").build(model.config).layers[1].retention) == (
        "KnormPolicy(budget=10, sinks=0, recent=0, compress='prefill')")


@pytest.mark.parametrize("budget", [5, 11])
def test_it_keeps_exactly_the_lowest_norm_keys(model, budget):
    ids = checks.prompt(batch=2, tokens=20)
    cache = checks.prefilled(model, f"knorm:{budget}", ids)
    want = [checks.top_positions(-keys.norm(dim=-1), budget) for keys in checks.full_keys(model, ids)]
    assert checks.kept_positions(cache) == want


def test_sinks_and_recent_tokens_stay_whatever_their_norm(model):
    ids = checks.prompt(tokens=20)
    cache = checks.prefilled(model, "knorm:9:sinks=2:recent=3", ids)
    for keys, kept in zip(checks.full_keys(model, ids), checks.kept_positions(cache), strict=True):
        scores = -keys.norm(dim=-1)
        scores[..., :2] = scores[..., -3:] = float("inf")
        assert kept == checks.top_positions(scores, 9)


@pytest.mark.parametrize("slots", checks.FORMATS)
def test_generate_evicts_to_the_budget_eager_and_compiled(model, slots):
    checks.in_generate(model, "knorm", slots)
