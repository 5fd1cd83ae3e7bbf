"""Budgets as shares of the prompt (`budget=0.2`, spec `h2o:20%`) in every evicting cache: the share becomes
int(share x the first forward's tokens per row) at that forward, the same count for every row (kvpress's count for
compression_ratio = 1 - share), after which the cache is the one built with that count (token-identical output); bad
shares and counts the policy cannot hold are typed errors naming the numbers, raised before any layer changes; reset()
sizes it again at the next prompt."""

import copy
import pickle

import pytest
import torch
from test_kvzap import random_surrogate
from test_kvzip import PROMPT

from conformance.models import PAD_TOKEN_ID, get_model
from conformance.modes import make_prompt
from hf_kvplus import (
    ConfigError,
    EvictingCache,
    H2OCache,
    KVzapCache,
    KVzipCache,
    SinkCache,
    SnapKVCache,
    cache_kwargs,
)
from hf_kvplus.evicting_cache import PeakCache
from hf_kvplus.eviction import HeavyHitterPolicy
from hf_kvplus.eviction.budget import prompt_share
from hf_kvplus.specs import parse_cache_spec

#: Each evicting cache by a budget (tokens or share), on a model's config.
CACHES = {
    "sink": lambda c, b: SinkCache(c, num_sinks=2, budget=b),
    "h2o": lambda c, b: H2OCache(c, budget=b),
    "h2o compileable": lambda c, b: H2OCache(c, budget=b, compileable=True),  # (budget + 1 slots, sized at the prompt)
    "snapkv": lambda c, b: SnapKVCache(c, budget=b, observation=4, kernel_size=3),
    "peak": lambda c, b: PeakCache(c, budget=b),
    "kvzap": lambda c, b: KVzapCache(c, random_surrogate(c), budget=b, sinks=2),
    "generic": lambda c, b: EvictingCache(c, lambda spec, tokens: HeavyHitterPolicy(tokens, 2), budget=b),
}


@pytest.mark.parametrize("keep", [0.125, 0.25, 0.5, 0.75, 1.0])
def test_a_share_counts_the_tokens_as_kvpress_does(keep):
    """kvpress keeps int(k_len x (1 - compression_ratio)) of a prefill's k_len keys; with compression_ratio = 1 - keep
    (these shares are exact in binary, so 1 - (1 - keep) == keep) that is this count, for every length."""
    for n in range(1, 300):
        assert prompt_share(keep, n) == max(1, int(n * (1 - (1 - keep)))), n


def test_a_fifth_counts_one_more_than_kvpress_where_a_fifth_is_whole():
    """compression_ratio=0.8 keeps int(n x 0.19999999999999996): one fewer than int(0.2 x n) where 0.2 x n is whole."""
    for n in range(5, 300):
        assert prompt_share(0.2, n) == int(n * (1 - 0.8)) + (n % 5 == 0), n


@pytest.mark.parametrize("name", list(CACHES))
def test_a_share_of_the_prompt_gives_what_that_many_tokens_give(name):
    model = get_model("llama")
    prompt = make_prompt(40)
    by_share, by_count = CACHES[name](model.config, 0.25), CACHES[name](model.config, 10)
    assert by_share.budget_tokens is None and by_share.budget == 0.25
    outs = [model.generate(prompt, **cache_kwargs(c), max_new_tokens=6, do_sample=False) for c in (by_share, by_count)]
    assert by_share.budget_tokens == 10  # int(0.25 x 40)
    assert torch.equal(outs[0], outs[1])
    held = [[layer.storage.held for layer in c.layers] for c in (by_share, by_count)]
    assert held[0] == held[1]
    assert "update" not in by_share.__dict__  # sized: the class's update from now on


def test_kvzip_sizes_at_the_context_prefill():
    model = get_model("llama")
    context = make_prompt(40)
    cache = KVzipCache(model.config, budget=0.25, sinks=2, budgets="uniform")
    with torch.no_grad():
        model(context, **cache_kwargs(cache))
        cache.compress(model, context, prompt=PROMPT)
    assert cache.budget_tokens == 10 and [layer.storage.held for layer in cache.layers] == [10] * len(cache.layers)


def test_the_count_is_the_padded_prompt_s_for_every_row():
    """Rows share their slots, so one count serves the batch: the padded length's share, as kvpress counts k_len; a
    padded row's padding goes first, so it keeps more of its own tokens than the share of its real length."""
    model = get_model("llama")
    prompt = make_prompt(40, batch=2)
    prompt[1, :12] = PAD_TOKEN_ID
    mask = (prompt != PAD_TOKEN_ID).long()
    cache = H2OCache(model.config, budget=0.25, recent=2)
    model.generate(prompt, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=2, do_sample=False)
    assert cache.budget_tokens == 10
    pos = cache.layers[0].storage.positions
    assert ((pos[1] >= 12).sum(-1) == 10).all()  # row 1: no padding kept, 10 of its 28 real tokens


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda c: H2OCache(c, budget=1.5), r"budget=1.5 as a share of the prompt must be in \(0, 1\]"),
        (lambda c: SnapKVCache(c, budget=0.0), r"budget=0.0 as a share"),
        (lambda c: PeakCache(c, budget=-0.2), r"budget=-0.2 as a share"),
        (lambda c: SinkCache(c, budget=True), r"got True"),
        (lambda c: KVzipCache(c, budget="20%"), r"got '20%'"),
        (lambda c: SinkCache(c, window=8, budget=0.5), r"give window=8 or budget=0.5"),
        (lambda c: SinkCache(c, num_sinks=4, budget=4), r"budget of 4 tokens leaves no window after num_sinks=4"),
    ],
)
def test_shares_out_of_range_are_refused_with_the_numbers(build, match):
    with pytest.raises(ConfigError, match=match):
        build(get_model("llama").config)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda c: SinkCache(c, num_sinks=4, budget=0.1), r"budget=0.1 of a 40-token prompt is int\(0.1 x 40\) = 4 "
                                                          r"tokens, too few: .*num_sinks=4"),
        (lambda c: KVzapCache(c, random_surrogate(c), budget=0.05, sinks=4),
         r"= 2 tokens, too few: sinks=4 \+ recent=0"),
        (lambda c: SnapKVCache(c, budget=0.5), r"= 20 tokens, too few: .*\(20\) must exceed the observation window"),
    ],
)
def test_a_count_below_what_the_policy_keeps_unranked_is_refused_before_any_layer_changes(build, match):
    model = get_model("llama")
    cache = build(model.config)
    with pytest.raises(ConfigError, match=match), torch.no_grad():
        model(make_prompt(40), **cache_kwargs(cache))
    assert cache.get_seq_length() == 0 and cache.budget_tokens is None  # unchanged: a longer prompt still works
    with torch.no_grad():
        model(make_prompt(400), **cache_kwargs(cache))
    assert cache.budget_tokens == int(cache.budget * 400)


def test_reset_and_copies_size_again_at_the_next_prompt():
    model = get_model("llama")
    cache = H2OCache(model.config, budget=0.25)
    fresh = pickle.loads(pickle.dumps(cache))
    copied = copy.deepcopy(cache)
    with torch.no_grad():
        model(make_prompt(40), **cache_kwargs(cache))
        assert cache.budget_tokens == 10
        cache.reset()
        assert cache.budget_tokens is None
        model(make_prompt(80), **cache_kwargs(cache))
        model(make_prompt(24), **cache_kwargs(fresh))
        model(make_prompt(60), **cache_kwargs(copied))
    assert (cache.budget_tokens, fresh.budget_tokens, copied.budget_tokens) == (20, 6, 15)
    assert cache.layers[0].retention.budget == 20


@pytest.mark.parametrize(
    "text, kind, budget",
    [("h2o:20%", H2OCache, 0.2), ("snapkv:0.5:observation=4", SnapKVCache, 0.5), ("peak:25%", PeakCache, 0.25),
     ("kvzip:10%", KVzipCache, 0.1), ("sink:4:25%", SinkCache, 0.25), ("h2o:64", H2OCache, 64)],
)
def test_specs_take_shares(text, kind, budget):
    cache = parse_cache_spec(text).build(get_model("llama").config)
    assert type(cache) is kind and cache.budget == budget


@pytest.mark.parametrize("text, match", [("h2o:150%", r"budget=1.5 as a share"), ("snapkv:0.0", r"budget=0.0"),
                                         ("peak:x%", r"tokens \(1024\) or a share"), ("h2o:0", "at least 1 token")])
def test_specs_refuse_bad_shares(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_cache_spec(text)
