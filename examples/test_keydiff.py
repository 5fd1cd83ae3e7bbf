"""KeyDiff from outside the package: registered by importing `keydiff`, it keeps the keys least like the mean unit key
of their KV head (a hand computation on the model's own keys), evicts to its budget in `generate()` on every slot
format, and compiles."""

import keydiff
import policy_checks as checks
import pytest
import torch.nn.functional as F

from hf_kvplus import EvictingCache
from hf_kvplus.specs import parse_cache_spec


def test_it_registers_under_its_spec_name(model):
    cache = EvictingCache(model.config, keydiff.KeyDiffPolicy(10, recent=2))
    assert repr(cache.layers[1].retention) == "KeyDiffPolicy(budget=10, sinks=0, recent=2, compress='prefill')"
    assert cache.layers[0].retention is not cache.layers[1].retention, "one policy per layer"
    assert type(parse_cache_spec("keydiff:20%").build(model.config).layers[0].retention) is keydiff.KeyDiffPolicy


@pytest.mark.parametrize("budget", [6, 13])
def test_it_keeps_the_keys_least_like_the_mean_key(model, budget):
    ids = checks.prompt(batch=2, tokens=20)
    cache = checks.prefilled(model, f"keydiff:{budget}", ids)
    want = []
    for keys in checks.full_keys(model, ids):
        unit = keys / keys.norm(dim=-1, keepdim=True)
        anchor = unit.mean(dim=2, keepdim=True)
        want.append(checks.top_positions(-(unit * F.normalize(anchor, dim=-1)).sum(-1), budget))
    assert checks.kept_positions(cache) == want


@pytest.mark.parametrize("slots", checks.FORMATS)
def test_generate_evicts_to_the_budget_eager_and_compiled(model, slots):
    checks.in_generate(model, "keydiff", slots)
