"""The paged cache's prefix store at its boundaries: it files blocks only under the token ids their row holds.

What `PagedCache` promises: after any call path, a later `reuse_prefix(ids)` + `generate(ids)` gives DynamicCache's
tokens; a `store_prefix` that cannot know what its blocks hold refuses with a typed error (`KVPlusError`), naming
the row, padding or mismatch, and leaves the store as it was. Every case runs on one tiny random Llama (all layers
full attention, so the pool has a prefix store), blocks of 8 tokens.
"""

import pytest
import torch
from transformers import DynamicCache

from conformance.models import PAD_TOKEN_ID, build_assistant, build_model, get_assistant, get_model
from hf_kvplus import KVPlusError, PagedCache, PagedPool, cache_kwargs

BS = 8
GREEDY = dict(max_new_tokens=6, do_sample=False)


def prompt(n, seed=0, batch=1):
    ids = torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed), device="cpu")
    return ids.to(torch.get_default_device())


def dynamic(model, ids, **kwargs):
    """DynamicCache's output for `ids`: what a reusing cache must give."""
    kwargs = {**GREEDY, **kwargs}
    return model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), **kwargs)


def store_or_refuse(cache, ids) -> int:
    """`store_prefix(ids)`: stored blocks, or -1 when refused with a typed error."""
    try:
        return cache.store_prefix(ids)
    except KVPlusError:
        return -1


def assert_reuse_is_exact(model, pool, ids, namespace="default"):
    """A later call that reuses what the store holds for `ids` generates DynamicCache's tokens."""
    reusing = PagedCache(config=model.config, pool=pool, namespace=namespace)
    reused = reusing.reuse_prefix(ids)
    out = model.generate(ids, **cache_kwargs(reusing), **GREEDY)
    assert torch.equal(out, dynamic(model, ids)), f"reused {reused} tokens and generated other tokens than DynamicCache"
    return reused


def check_pool(pool):
    pool.blocks["full"].check()
    pool.prefix_store.check()


# -------------------------------------------------------------------------------------------- rows that differ
@pytest.mark.parametrize("told", [False, True], ids=["plain-generate", "after-reuse_prefix"])
def test_a_sampled_row_is_stored_under_its_own_tokens_or_refused(told):
    """`num_return_sequences=4` samples rows that differ from the first generated token on; storing row 1's output
    must not file row 0's blocks under row 1's tokens: a later reuse of row 1 gives DynamicCache's tokens."""
    model = get_model("llama")
    pool = PagedPool(model.config, block_size=BS)
    P = prompt(20, seed=1)
    cache = PagedCache(config=model.config, pool=pool)
    if told:
        cache.reuse_prefix(P)
    torch.manual_seed(5)
    out = model.generate(P, **cache_kwargs(cache), do_sample=True, num_return_sequences=4, max_new_tokens=12)
    assert not torch.equal(out[0, 20:24], out[1, 20:24])  # the rows differ inside the third block
    stored = store_or_refuse(cache, out[1:2])
    if told:
        assert stored == 2  # the prompt's two full blocks: the cache knows the prompt, not what it sampled
    check_pool(pool)
    assert_reuse_is_exact(model, pool, out[1:2])


@pytest.mark.parametrize("told", [False, True], ids=["plain-generate", "after-reuse_prefix"])
def test_a_beam_that_differs_early_is_stored_under_its_own_tokens_or_refused(told):
    """Beam search reorders the cache's rows; `store_prefix(out[1:2])` must not file the cache's row 0 (another
    beam) under beam 1's tokens."""
    model = get_model("llama")
    pool = PagedPool(model.config, block_size=BS)
    P = prompt(20, seed=8)  # (its beams differ from the second generated token on)
    cache = PagedCache(config=model.config, pool=pool)
    if told:
        cache.reuse_prefix(P)
    out = model.generate(P, **cache_kwargs(cache), num_beams=4, num_return_sequences=4, max_new_tokens=12,
                         do_sample=False)  # fmt: skip
    rows = [out[r : r + 1] for r in range(4)]
    assert any(not torch.equal(r[0, 20:24], out[0, 20:24]) for r in rows)
    for r in rows:
        store_or_refuse(cache, r)
    check_pool(pool)
    for r in rows:
        assert_reuse_is_exact(model, pool, r)


@pytest.mark.parametrize("pad", [3, 8, 11])
@pytest.mark.parametrize("what", ["real-tokens", "padded-row"])
def test_a_left_padded_row_is_stored_only_as_it_holds_or_refused(pad, what):
    """A batch of two prompts, the second left-padded by `pad` tokens (a whole block or not): storing the padded
    row (its real tokens, or the row with its pads) must not file another row's blocks nor blocks shifted by the
    padding; a later reuse of its tokens gives DynamicCache's."""
    model = get_model("llama")
    pool = PagedPool(model.config, block_size=BS)
    long, short = prompt(30, seed=3), prompt(30 - pad, seed=4)
    ids = torch.cat([long, torch.cat([torch.full((1, pad), PAD_TOKEN_ID), short], dim=1)])
    mask = (ids != PAD_TOKEN_ID).long()
    mask[0] = 1
    cache = PagedCache(config=model.config, pool=pool)
    out = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), **GREEDY)
    row = out[1:2, pad:] if what == "real-tokens" else out[1:2]
    store_or_refuse(cache, row)
    check_pool(pool)
    assert_reuse_is_exact(model, pool, out[1:2, pad:])


# -------------------------------------------------------------------------------------- other tokens than held
@pytest.mark.parametrize("told", [False, True], ids=["plain-generate", "after-reuse_prefix"])
def test_storing_other_ids_than_the_cache_processed_is_refused(told):
    """`store_prefix(Q)` on a cache that holds prompt P must not file P's blocks under Q (one wrong call would poison
    the namespace for every later request): it refuses, and a later reuse of Q is exact."""
    model = get_model("llama")
    pool = PagedPool(model.config, block_size=BS)
    P, Q = prompt(30, seed=6), prompt(30, seed=7)
    cache = PagedCache(config=model.config, pool=pool)
    if told:
        cache.reuse_prefix(P)
    model.generate(P, **cache_kwargs(cache), **GREEDY)
    assert store_or_refuse(cache, Q) <= 0
    assert len(pool.prefix_store) == 0
    check_pool(pool)
    assert_reuse_is_exact(model, pool, Q)


def test_a_refusal_names_what_the_cache_knows():
    """The refusal is typed and says why: a cache never told its prompt, and a prompt other than the one told."""
    model = get_model("llama")
    P, Q = prompt(30, seed=6), prompt(30, seed=7)
    cache = PagedCache(config=model.config, block_size=BS)
    model.generate(P, **cache_kwargs(cache), **GREEDY)
    with pytest.raises(KVPlusError, match="reuse_prefix"):
        cache.store_prefix(P)
    told = PagedCache(config=model.config, block_size=BS)
    told.reuse_prefix(P)
    model.generate(P, **cache_kwargs(told), **GREEDY)
    with pytest.raises(KVPlusError, match="token 0"):
        told.store_prefix(Q)
    assert told.store_prefix(P) == 3


def test_a_forward_that_feeds_another_prompt_than_told_cannot_store():
    """`reuse_prefix(P)` tells the cache its prompt; a generate that then feeds a prompt of another length (what the
    cache sees of the first forward) leaves the cache unable to store: refused, nothing filed."""
    model = get_model("llama")
    pool = PagedPool(model.config, block_size=BS)
    P, Q = prompt(30, seed=8), prompt(27, seed=9)
    cache = PagedCache(config=model.config, pool=pool)
    cache.reuse_prefix(P)
    model.generate(Q, **cache_kwargs(cache), **GREEDY)
    assert store_or_refuse(cache, P) == -1
    assert len(pool.prefix_store) == 0


def test_the_documented_flow_stores_and_reuses_exactly():
    """reuse_prefix -> generate -> store_prefix, twice: the second call reuses the first's blocks and generates
    DynamicCache's tokens; storing the output (prompt and generated tokens) files the prompt's blocks only."""
    model = get_model("llama")
    pool = PagedPool(model.config, block_size=BS)
    P = prompt(30, seed=10)
    cache = PagedCache(config=model.config, pool=pool)
    assert cache.reuse_prefix(P) == 0
    out = model.generate(P, **cache_kwargs(cache), **GREEDY)
    assert cache.store_prefix(out) == 3
    del cache
    second = torch.cat([P, prompt(5, seed=11)], dim=1)
    assert assert_reuse_is_exact(model, pool, second) == 24
    check_pool(pool)


# ------------------------------------------------------------------------------------ generate modes after reuse
def reused_cache(model, pool, P):
    cache = PagedCache(config=model.config, pool=pool)
    assert cache.reuse_prefix(P) == 24
    return cache


def stored_pool(model, P):
    pool = PagedPool(model.config, block_size=BS)
    cache = PagedCache(config=model.config, pool=pool)
    cache.reuse_prefix(P)
    model.generate(P, **cache_kwargs(cache), **GREEDY)
    assert cache.store_prefix(P) == 3
    return pool


@pytest.mark.parametrize("mode", ["assistant", "prompt-lookup"])
def test_assisted_decoding_after_reuse_is_exact_or_refused(mode):
    """Assisted or prompt-lookup decoding after `reuse_prefix` gives DynamicCache's tokens, or refuses with a typed
    error before generating (Transformers' assisted decoding mishandles a prefilled cache)."""
    model = get_model("llama")
    P = prompt(30, seed=12)
    pool = stored_pool(model, P)
    kwargs = {"assistant_model": get_assistant("llama")} if mode == "assistant" else {"prompt_lookup_num_tokens": 3}
    kwargs.update(max_new_tokens=8, do_sample=False)
    try:
        out = model.generate(P, **cache_kwargs(reused_cache(model, pool, P)), **kwargs)
    except KVPlusError as exc:
        assert "reuse_prefix" in str(exc)
        return
    assert torch.equal(out, dynamic(model, P, max_new_tokens=8))


def test_beams_after_reuse_expand_the_attached_rows():
    """Beam search after `reuse_prefix` fans the attached prompt out to the beams: DynamicCache's beams."""
    model = get_model("llama")
    P = prompt(30, seed=13)
    pool = stored_pool(model, P)
    kwargs = dict(num_beams=3, num_return_sequences=3, max_new_tokens=6, do_sample=False)
    out = model.generate(P, **cache_kwargs(reused_cache(model, pool, P)), **kwargs)
    assert torch.equal(out, model.generate(P, **cache_kwargs(DynamicCache(config=model.config)), **kwargs))
    check_pool(pool)


def test_samples_after_reuse_expand_the_attached_rows():
    """`num_return_sequences` after `reuse_prefix` fans the attached prompt out to the samples: DynamicCache's
    samples for the same seed."""
    model = get_model("llama")
    P = prompt(30, seed=14)
    pool = stored_pool(model, P)
    kwargs = dict(num_return_sequences=3, max_new_tokens=6, do_sample=True, top_k=4)
    torch.manual_seed(3)
    out = model.generate(P, **cache_kwargs(reused_cache(model, pool, P)), **kwargs)
    torch.manual_seed(3)
    assert torch.equal(out, model.generate(P, **cache_kwargs(DynamicCache(config=model.config)), **kwargs))
    check_pool(pool)


def test_a_batch_of_other_prompts_after_reuse_is_refused():
    """`reuse_prefix(P)` attaches one prompt's blocks; a batch whose rows differ cannot share them: typed error."""
    model = get_model("llama")
    P = prompt(30, seed=15)
    pool = stored_pool(model, P)
    batch = torch.cat([P, torch.cat([P[:, :27], prompt(3, seed=16)], dim=1)])
    with pytest.raises(KVPlusError, match="rows"):
        model.generate(batch, **cache_kwargs(reused_cache(model, pool, P)), **GREEDY)


# ------------------------------------------------------------------------------------------------ dtype after reset
def test_a_cache_with_its_own_pool_takes_a_new_dtype_after_reset():
    """Every cache takes a new dtype after `reset()`; a PagedCache with a pool of its own too: bfloat16 after
    float32, DynamicCache's tokens."""
    model = build_model("llama")
    P = prompt(20, seed=17)
    cache = PagedCache(config=model.config, block_size=BS)
    model.generate(P, **cache_kwargs(cache), **GREEDY)
    cache.reset()
    half = build_model("llama").to(torch.bfloat16)
    out = half.generate(P, **cache_kwargs(cache), **GREEDY)
    assert torch.equal(out, dynamic(half, P))


def test_the_assistant_fixture_is_a_truncated_copy():
    """(Sanity of the fixture the assisted case uses: its draft agrees with the model sometimes.)"""
    assert build_assistant(get_model("llama"), "llama").config.num_hidden_layers == 2
