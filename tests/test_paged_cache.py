"""PagedCache: sharing and copy-on-write, leaks, exhaustion, windows freeing blocks, bytes, prefix reuse."""

import gc

import pytest
import torch
from transformers import DynamicCache

from conformance.models import PAD_TOKEN_ID, build_model
from hf_kvplus import (
    CacheMismatchError,
    CapacityError,
    ConfigError,
    PagedCache,
    PagedPool,
    UnsupportedOperationError,
    cache_kwargs,
)


def prompt(n, seed=0, batch=1):
    ids = torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed), device="cpu")
    return ids.to(torch.get_default_device())


def free_blocks(pool: PagedPool) -> dict:
    return {key: blocks.num_free for key, blocks in pool.blocks.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_released_cache_leaves_the_pool_as_it_was(arch):
    model = build_model(arch)
    pool = PagedPool(model.config, block_size=8)
    model.generate(prompt(5), **cache_kwargs(PagedCache(config=model.config, pool=pool)), max_new_tokens=2)
    before = free_blocks(pool)
    cache = PagedCache(config=model.config, pool=pool)
    model.generate(prompt(21), **cache_kwargs(cache), num_beams=3, num_return_sequences=2, max_new_tokens=9)
    assert free_blocks(pool) != before
    del cache
    gc.collect()
    assert free_blocks(pool) == before
    for blocks in pool.blocks.values():
        blocks.check()


def test_rows_of_one_prompt_share_blocks_and_copy_only_a_partial_last_block():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8)
    ids = prompt(20)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        blocks = cache.block_pools()["full"]
        assert blocks.num_used == 3  # 20 tokens in blocks of 8
        cache.batch_repeat_interleave(3)
        assert blocks.num_used == 3  # shared, not copied
        step = torch.tensor([[7], [8], [9]])
        model(step, **cache_kwargs(cache))
        assert blocks.num_used == 5  # rows 1 and 2 got their own copy of the partly filled third block
        reference = DynamicCache(config=model.config)
        model(ids, **cache_kwargs(reference))
        reference.batch_repeat_interleave(3)
        model(step, **cache_kwargs(reference))
    for ours, theirs in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_beams_from_one_prompt_share_the_prompt_blocks():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8)
    with torch.no_grad():
        model(prompt(24, batch=1).repeat(4, 1), **cache_kwargs(cache))
    assert cache.block_pools()["full"].num_used == 3  # 4 identical rows, 3 blocks each, stored once


def test_a_full_pool_raises_with_numbers_and_the_cache_stays_consistent():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8, num_blocks=4)
    with torch.no_grad():
        model(prompt(30), **cache_kwargs(cache))  # 4 blocks
        with pytest.raises(CapacityError, match=r"needs 1 blocks?, 0 free of 4"):
            model(torch.tensor([[5, 6, 7]]), **cache_kwargs(cache))
    assert cache.get_seq_length() == 30
    blocks = cache.block_pools()["full"]
    blocks.check()
    cache.crop(-6)
    with torch.no_grad():
        model(torch.tensor([[5, 6]]), **cache_kwargs(cache))  # fits again
    assert cache.get_seq_length() == 26
    cache.reset()
    assert blocks.num_free == 4


def test_reserved_tables_take_their_blocks_at_the_first_fill_and_count_them_as_headroom():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8, max_tokens=40)
    blocks = cache.block_pools()["full"]
    with torch.no_grad():
        model(prompt(13, batch=2), **cache_kwargs(cache))
        assert blocks.num_used == 10  # 2 rows x 5 columns of 8, taken at once
        for token in range(27):  # up to 40 tokens: no more blocks, a table that never changes width
            model(torch.tensor([[3 + token], [4 + token]]), **cache_kwargs(cache))
            assert blocks.num_used == 10 and cache.groups["full"].table_tensor(torch.device("cpu")).shape == (2, 5)
        with pytest.raises(CapacityError, match="41 tokens per row do not fit in the cache's max_tokens=40"):
            model(torch.tensor([[3], [4]]), **cache_kwargs(cache))
    assert cache.get_seq_length() == 40


def test_reserved_tables_report_the_blocks_ahead_as_reserved():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8, max_tokens=64, num_blocks=32)
    with torch.no_grad():
        model(prompt(20, batch=2), **cache_kwargs(cache))
    layers = len(cache.layers)
    block = cache.layers[0].storage.pool.block_bytes
    report = cache.memory_report()
    # 3 written columns and 5 ahead per row; the free blocks of the cache's own pool are headroom too
    assert report.payload_bytes == layers * 2 * 3 * block
    assert report.reserved_bytes == layers * (2 * 5 + 32 - 16) * block


def test_a_pool_too_small_for_the_reservation_raises_and_takes_nothing():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8, max_tokens=64, num_blocks=12)
    with torch.no_grad(), pytest.raises(CapacityError, match="needs 16 blocks, 12 free of 12"):
        model(prompt(20, batch=2), **cache_kwargs(cache))
    blocks = cache.block_pools()["full"]
    assert blocks.num_free == 12 and not cache.groups["full"].tables
    blocks.check()


def test_rows_of_one_prompt_share_the_prompt_but_own_the_blocks_they_write_next():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8, max_tokens=32)
    with torch.no_grad():
        model(prompt(20).repeat(3, 1), **cache_kwargs(cache))  # three rows of one prompt
    tables = cache.groups["full"].tables
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the two full blocks, stored once
    ahead = [block for table in tables for block in table[2:]]  # the partial block and the one after it
    assert len(set(ahead)) == len(ahead) == 6
    cache.reorder_cache(torch.tensor([1, 1, 0]))  # row 1 twice: its blocks ahead are copied for one of them
    tables = cache.groups["full"].tables
    ahead = [block for table in tables for block in table[2:]]
    assert len(set(ahead)) == 6 and cache.block_pools()["full"].num_used == 2 + 6
    cache.block_pools()["full"].check()


def test_a_pool_that_runs_out_while_unsharing_leaves_every_table_naming_its_tokens():
    model = build_model("llama")
    cache = PagedCache(config=model.config, block_size=8, max_tokens=32, num_blocks=9)
    with torch.no_grad():
        model(prompt(20).repeat(3, 1), **cache_kwargs(cache))  # 2 shared blocks + 2 of each row's own: 1 free
    with pytest.raises(CapacityError, match=r"needs 1 blocks?, 0 free of 9"):
        cache.batch_repeat_interleave(2)  # 6 rows: the second copy of a block ahead finds no room
    group, pool = cache.groups["full"], cache.layers[0].storage.pool
    partial = {table[2] for table in group.tables}  # the block holding tokens 16..19, one per row or shared
    assert len(partial) == 4  # the three rows' own, and the one copy that was made
    for block in partial:  # every one holds the prompt's tokens, the copy included
        assert torch.equal(pool.k[block, :, :4], pool.k[group.tables[-1][2], :, :4])
    assert pool.k[group.tables[0][2], :, :4].abs().sum() > 0


def test_sliding_layers_free_blocks_that_left_the_window():
    model = build_model("mistral")  # every layer slides over 8 tokens
    cache = PagedCache(config=model.config, block_size=8)
    with torch.no_grad():
        model(prompt(40), **cache_kwargs(cache))
        for token in range(30):
            model(torch.tensor([[3 + token]]), **cache_kwargs(cache))
    report = cache.memory_report()
    assert report.tokens_seen == 70 and report.tokens_held == 7
    assert cache.block_pools()["sliding:8"].num_used <= 2


def test_a_pool_the_padded_prefill_fills_takes_the_zero_block_from_the_padding_it_frees():
    """8 blocks of 8 hold a 2 x 32 prefill exactly; at the next step the 3 blocks of row 1's 24 padding tokens give
    way to one zero block taken from them (not a ninth, which a fixed pool refuses and a growable one grows all its
    layers' tensors for), and the step's 2 new blocks fit in what remains."""
    model = build_model("llama")
    ids, mask = prompt(32, batch=2), torch.ones(2, 32, dtype=torch.long)
    mask[1, :24] = 0
    ids = ids.masked_fill(mask == 0, PAD_TOKEN_ID)
    cache, reference = PagedCache(config=model.config, block_size=8, num_blocks=8), DynamicCache(config=model.config)
    step = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwargs(cache))
        assert cache.block_pools()["full"].num_free == 0
        # The step releases the padding (3 blocks back, 1 zero block), then takes a new block per row.
        ours = model(torch.tensor([[5]] * 2), attention_mask=step, **cache_kwargs(cache)).logits
        model(ids, attention_mask=mask, **cache_kwargs(reference))
        theirs = model(torch.tensor([[5]] * 2), attention_mask=step, **cache_kwargs(reference)).logits
    assert cache.block_pools()["full"].num_free == 0
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_bytes_at_rest_are_within_one_block_per_row_and_layer_of_the_real_tokens():
    """Blocks holding only left padding are swapped for one shared zero block after the prefill."""
    model = build_model("llama")
    lengths = [3, 9, 17, 30]
    ids = prompt(30, batch=4)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, 30 - length :] = 1
    cache = PagedCache(config=model.config, block_size=8)
    with torch.no_grad():
        model(ids.masked_fill(mask == 0, PAD_TOKEN_ID), attention_mask=mask, **cache_kwargs(cache))
    config = model.config
    per_token = 2 * config.num_key_value_heads * config.head_dim * 4  # one layer, float32
    report = cache.memory_report()
    layers, block = config.num_hidden_layers, 8 * per_token
    real = sum(lengths) * per_token * layers
    assert real <= report.payload_bytes <= real + 4 * layers * block + layers * block  # + the zero block
    assert report.payload_bytes < 4 * 30 * per_token * layers  # less than the padded batch
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        ours = model(torch.tensor([[5]] * 4), attention_mask=torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], 1),
                     **cache_kwargs(cache)).logits
        model(ids.masked_fill(mask == 0, PAD_TOKEN_ID), attention_mask=mask, **cache_kwargs(reference))
        theirs = model(torch.tensor([[5]] * 4), attention_mask=torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], 1),
                       **cache_kwargs(reference)).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_prefix_reuse_skips_the_stored_prefix_and_gives_the_same_tokens():
    model = build_model("llama")
    pool = PagedPool(model.config, block_size=8)
    first, second = prompt(30, seed=1), torch.cat([prompt(30, seed=1)[:, :27], prompt(6, seed=2)], dim=1)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    cache = PagedCache(config=model.config, pool=pool, namespace="tenant-a")
    assert cache.reuse_prefix(first) == 0
    model.generate(first, **cache_kwargs(cache), **kwargs)
    assert cache.store_prefix(first) == 3
    del cache
    reusing = PagedCache(config=model.config, pool=pool, namespace="tenant-a")
    assert reusing.reuse_prefix(second) == 24  # the three full blocks the prompts share
    out = model.generate(second, **cache_kwargs(reusing), **kwargs)
    fresh = model.generate(second, **cache_kwargs(DynamicCache(config=model.config)), **kwargs)
    assert torch.equal(out, fresh)
    assert pool.prefix_store.stats.hit_blocks == 3


def test_a_prefix_stored_for_one_namespace_is_never_served_to_another():
    model = build_model("llama")
    pool = PagedPool(model.config, block_size=8)
    ids = prompt(30, seed=3)
    cache = PagedCache(config=model.config, pool=pool, namespace="tenant-a")
    cache.reuse_prefix(ids)
    model.generate(ids, **cache_kwargs(cache), max_new_tokens=2)
    cache.store_prefix(ids)
    assert PagedCache(config=model.config, pool=pool, namespace="tenant-b").reuse_prefix(ids) == 0
    assert PagedCache(config=model.config, pool=pool, namespace="tenant-a").reuse_prefix(ids) == 24


def test_prefix_reuse_is_refused_where_it_cannot_work():
    hybrid = build_model("qwen2")
    with pytest.raises(UnsupportedOperationError, match=r"all full attention; .*sliding:8"):
        PagedCache(config=hybrid.config).reuse_prefix(prompt(20))
    model = build_model("llama")
    cache = PagedCache(config=model.config)
    with torch.no_grad():
        model(prompt(5), **cache_kwargs(cache))
    with pytest.raises(UnsupportedOperationError, match="needs an empty cache; this one holds 5 tokens"):
        cache.reuse_prefix(prompt(20))
    with pytest.raises(ConfigError, match=r"one prompt, .* got shape \(2, 20\)"):
        PagedCache(config=model.config).reuse_prefix(prompt(20, batch=2))


def test_a_memory_budget_fixes_the_pools():
    config = build_model("qwen2").config  # one sliding layer group and one full layer group
    head_dim = config.hidden_size // config.num_attention_heads
    block = 2 * config.num_key_value_heads * 8 * head_dim * 4  # one layer, float32
    cache = PagedCache(config=config, block_size=8, max_bytes=3 * 10 * block)
    pools = cache.block_pools()
    assert pools["full"].is_fixed and pools["full"].capacity == 10  # one full layer of three: a third
    assert pools["sliding:8"].capacity == 10  # two sliding layers share two thirds
    with pytest.raises(ConfigError, match=r"max_bytes 100 leaves 66 bytes for the sliding:8 layers, less than one block of 4,096 bytes"):
        PagedCache(config=config, block_size=8, max_bytes=100)
    with pytest.raises(ConfigError, match="not both"):
        PagedCache(config=config, num_blocks=4, max_bytes=10**6)


def test_bad_construction_is_refused():
    config = build_model("llama").config
    with pytest.raises(ConfigError, match="power of two in 8..128, got 12"):
        PagedCache(config=config, block_size=12)
    with pytest.raises(ConfigError, match="num_blocks must be >= 1"):
        PagedCache(config=config, num_blocks=0)
    with pytest.raises(ConfigError, match="namespace must be a str"):
        PagedCache(config=config, namespace=3)
    with pytest.raises(ConfigError, match="max_tokens must be an int >= 1, got 0"):
        PagedCache(config=config, max_tokens=0)
    with pytest.raises(ConfigError, match="needs max_tokens"):
        PagedCache(config=config, compileable=True)
    with pytest.raises(ConfigError, match="max_tokens applies to full-precision blocks"):
        PagedCache(config=config, bits=4, max_tokens=64)


@pytest.mark.parametrize("bits", [None, 4])
def test_a_row_operation_reaches_every_layer_and_moves_the_shared_tables_once(bits):
    """Transformers reorders layer by layer; the block group applies each operation once for all its layers."""
    model = build_model("llama")
    kwargs = {} if bits is None else {"bits": bits, "group_size": 8, "window": 8}
    cache = PagedCache(config=model.config, block_size=8, **kwargs)
    model(prompt(27, seed=3, batch=3), **cache_kwargs(cache))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    order = torch.tensor([2, 0, 2])
    cache.reorder_cache(order)
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert layer.storage.batch_size == 3
        torch.testing.assert_close(layer.keys, keys[order], rtol=0, atol=0)
        torch.testing.assert_close(layer.values, values[order], rtol=0, atol=0)
    cache.batch_repeat_interleave(2)
    for layer, (keys, _) in zip(cache.layers, before, strict=True):
        torch.testing.assert_close(layer.keys, keys[order.repeat_interleave(2)], rtol=0, atol=0)
    # One layer reordered twice while the others did not follow: the next of them is refused.
    cache.layers[0].reorder_cache(torch.arange(6))
    cache.layers[0].reorder_cache(torch.arange(6))
    with pytest.raises(CacheMismatchError, match="member 1 .* 2 operations ahead"):
        cache.layers[1].reorder_cache(torch.arange(6))
