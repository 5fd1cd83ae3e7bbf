"""Peak attention (`PeakAttentionPolicy`, `PeakCache`): it keeps the tokens whose largest single-query attention ranks
highest, against an eager reference (the largest weight one query gave, not H2O's sum); it refuses budgets it cannot hold
with the numbers; and it runs through `generate()` in both compress modes, on full-precision and quantized slots,
with context compression paused by `appending()`."""

import pytest
import torch
from test_eviction_policies import GROUP, KV_HEADS, EagerReference, config, forward, kept_positions, qkv
from transformers import DynamicCache

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import ConfigError, SinkCache, UnsupportedOperationError, cache_kwargs
from hf_kvplus.evicting_cache import PeakCache
from hf_kvplus.eviction import PeakAttentionPolicy
from hf_kvplus.specs import parse_cache_spec


def peak_per_kv_head(weights):
    """`[batch, kv_heads, n]`: each query's weights summed over its KV head's group, then the largest over queries."""
    w = weights.view(weights.shape[0], KV_HEADS, GROUP, weights.shape[2], -1).sum(2)
    return w.amax(2)


@pytest.mark.parametrize("budget, recent, prefill, chunk, compress",
                         [(8, 2, 12, 1, "always"), (8, 0, 5, 1, "always"), (10, 3, 16, 3, "always"),
                          (6, 1, 20, 1, "prefill"), (9, 4, 14, 4, "prefill")])  # fmt: skip
def test_it_keeps_the_top_of_the_true_peak_attention(seed, budget, recent, prefill, chunk, compress):
    cache = PeakCache(config(), budget=budget, recent=recent, compress=compress)
    ref, batch, seen = EagerReference(2), 2, 0
    for new in [prefill] + [chunk] * 10:
        q, k, v = qkv(batch, new)
        out = forward(cache, q, k, v)
        weights = ref.attend(q, k, v)
        seen += new
        n = weights.shape[-1]
        ref.score[:, :, :n] = torch.maximum(ref.score[:, :, :n], peak_per_kv_head(weights))
        if new > 1 or compress == "always":
            ref.keep_top(ref.score, budget, lambda p, seen=seen: p >= seen - recent)
        assert kept_positions(cache) == ref.kept_positions(), f"seed {seed}, after {seen} tokens"
        expected = weights.float() @ ref.values.float().repeat_interleave(GROUP, 1)
        torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda c: PeakCache(c, budget=0), r"at least 1 token, got budget=0"),
        (lambda c: PeakCache(c, budget=8, recent=8), r"within 0\.\.budget - 1 = 7, got recent=8"),
        (lambda c: PeakCache(c, budget=8, recent=-1), r"got recent=-1"),
        (lambda c: PeakCache(c, budget=8, kernel_size=4), "positive odd number, got 4"),
        (lambda c: PeakCache(c, budget=8, compress="never"), "compress must be one of"),
        (lambda c: PeakCache(c, budget=8, recent=2, bits=4, first_tokens=7),
         r"first_tokens=7 does not fit.*budget - recent = 8 - 2 = 6"),
    ],
)
def test_budgets_it_cannot_hold_are_refused_with_the_numbers(build, match):
    with pytest.raises(ConfigError, match=match):
        build(config())
    assert PeakAttentionPolicy(8, 7).budget == 8


def test_specs_name_it_and_refuse_what_it_refuses():
    cache = parse_cache_spec("peak:64:recent=8:kernel=3:compress=prefill:bits=int4").build(config())
    policy = cache.layers[0].retention
    assert isinstance(cache, PeakCache) and cache.format is not None
    assert (policy.budget, policy.recent, policy.kernel_size, policy.compress) == (64, 8, 3, "prefill")
    assert parse_cache_spec("peak:64").build(config()).layers[0].retention.recent == 8  # an eighth by default
    with pytest.raises(ConfigError, match="got recent=64"):
        parse_cache_spec("peak:64:recent=64").build(config())
    with pytest.raises(ConfigError, match="unknown option|not accepted|observation"):
        parse_cache_spec("peak:64:observation=4")


@pytest.mark.parametrize("bits", [None, "int4", "k4v2"])
@pytest.mark.parametrize("compress", ["always", "prefill"])
def test_it_runs_through_generate_bounded_as_its_mode_says(bits, compress):
    model = get_model("llama")
    prompt = make_prompt(40)
    cache = PeakCache(model.config, budget=16, recent=4, bits=bits, compress=compress)
    out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    assert out.shape[1] == 46 and cache.get_seq_length() == 45  # (the last token is never fed back)
    held = cache.layers[0].storage.held
    assert held == (16 if compress == "always" else 16 + 5)


def test_with_room_for_every_token_it_decodes_as_dynamic():
    model = get_model("llama")
    prompt = make_prompt(30)
    want = model.generate(prompt, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=8, do_sample=False)
    got = model.generate(prompt, **cache_kwargs(PeakCache(model.config, budget=64)), max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def test_appending_pauses_eviction_for_the_question_and_refuses_a_compileable_cache():
    model = get_model("llama")
    cache = PeakCache(model.config, budget=16, recent=4, compress="prefill")
    with torch.no_grad():
        model(make_prompt(40), **cache_kwargs(cache))
        assert cache.layers[0].storage.held == 16
        with cache.appending():
            model(make_prompt(7, seed=3), **cache_kwargs(cache))  # a question: appended, not compressed
            assert cache.layers[0].storage.held == 23
        model(make_prompt(5, seed=4), **cache_kwargs(cache))  # outside: a prompt compresses again
    assert cache.layers[0].storage.held == 16
    compiled = SinkCache(model.config, num_sinks=2, window=6, compileable=True)
    with pytest.raises(UnsupportedOperationError, match="budget"), compiled.appending():
        pass
