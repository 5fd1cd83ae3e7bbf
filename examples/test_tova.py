"""TOVA from outside the package: registered by importing `tova`, it keeps the tokens the prompt's last query attends to
most (averaged over every query head: a hand computation from the model's eager attention weights) plus the newest,
the same in every KV head; evicts to its budget in `generate()` on every slot format, and compiles."""

import policy_checks as checks
import pytest
import torch
import tova
from transformers import LlamaForCausalLM

from hf_kvplus import EvictingCache
from hf_kvplus.specs import parse_cache_spec


def last_query_weights(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, `[batch, n]`: the last query's attention weights averaged over the query heads (eager attention)."""
    eager = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "attn_implementation": "eager"}))
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        attentions = eager.eval()(ids, output_attentions=True).attentions
    return [weights[:, :, -1].mean(dim=1) for weights in attentions]


def test_it_registers_under_its_spec_name(model):
    cache = EvictingCache(model.config, tova.TOVAPolicy, budget=10)
    assert repr(cache.layers[0].retention) == "TOVAPolicy(budget=10, sinks=0, recent=1, compress='prefill')"
    assert type(parse_cache_spec("tova:10").build(model.config).layers[0].retention) is tova.TOVAPolicy


@pytest.mark.parametrize("budget", [4, 9])
def test_it_keeps_what_the_last_query_reads_most_in_every_head(model, budget):
    ids = checks.prompt(batch=2, tokens=18)
    cache = checks.prefilled(model, f"tova:{budget}", ids)
    for weights, kept in zip(last_query_weights(model, ids), checks.kept_positions(cache), strict=True):
        weights[:, -1] = float("inf")  # the newest token stays (recent=1)
        heads = checks.top_positions(weights[:, None, :].expand(-1, 2, -1), budget)
        assert kept == heads
        assert all(row[0] == row[1] for row in kept), "every KV head keeps the same tokens"


@pytest.mark.parametrize("slots", checks.FORMATS)
def test_generate_evicts_to_the_budget_eager_and_compiled(model, slots):
    checks.in_generate(model, "tova", slots)
