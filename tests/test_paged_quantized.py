"""Paged and quantized at once: PagedCache(bits=...) holds the old tokens in quantized blocks of a shared pool.

The reference is the dense QuantizedCache: with blocks as large as the groups, both quantize the same tokens at the
same steps, so every logit agrees; with larger blocks they agree wherever both have quantized the same tokens.
"""

import gc
import os

import pytest
import torch
from transformers import DynamicCache, MistralForCausalLM

from conformance.models import get_model, make_config
from conformance.modes import make_prompt
from hf_kvplus import (
    CacheMismatchError,
    CapacityError,
    ConfigError,
    PagedCache,
    PagedPool,
    QuantizedCache,
    UnsupportedOperationError,
    cache_kwargs,
)
from hf_kvplus.kernels.quant_format import QuantFormat, dequantize_keys, quantize_keys
from hf_kvplus.paging import QuantLayerPool
from hf_kvplus.storage.paged_segment import PagedSegment


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny models run faster on one thread (as in test_conformance) unless OMP_NUM_THREADS says otherwise."""
    if os.environ.get("OMP_NUM_THREADS"):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def paged(model, **kwargs):
    kwargs = {"bits": 8, "group_size": 8, "window": 8, "block_size": 8, **kwargs}
    return PagedCache(model.config, **kwargs)


def dense(model, **kwargs):
    kwargs = {"bits": 8, "group_size": 8, "window": 8, **kwargs}
    return QuantizedCache(model.config, **kwargs)


def generate(model, cache, prompt, **kwargs):
    out = model.generate(prompt, **cache_kwargs(cache), do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **{"max_new_tokens": 6, **kwargs})
    return out.sequences, torch.stack(out.logits)


def segments(cache):
    return [layer.storage.segment for layer in cache.layers if hasattr(layer, "storage")]


def step(model, cache, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens), **cache_kwargs(cache)).logits


# ------------------------------------------------------------------------------------------------ the same values
@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_blocks_of_one_group_give_the_dense_quantized_cache_logits(arch, bits):
    """Block size == group size: both flush the same tokens at the same steps, so they hold the same codes."""
    model = get_model(arch)
    prompt = make_prompt(29, seed=5)
    ours = paged(model, bits=bits)
    seq, logits = generate(model, ours, prompt, max_new_tokens=8)
    ref_seq, ref_logits = generate(model, dense(model, bits=bits), prompt, max_new_tokens=8)
    assert all(isinstance(s, PagedSegment) for s in segments(ours))
    assert max(s.length for s in segments(ours)) == 24  # 36 seen, 8+ exact: three blocks quantized
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    exact = generate(model, DynamicCache(config=model.config), prompt, max_new_tokens=8)[1]
    assert not torch.allclose(logits, exact, atol=1e-5)  # quantized for real


def test_larger_blocks_agree_wherever_the_same_tokens_are_quantized():
    """Groups of 4, blocks of 8, window 4: dense flushes 4 tokens at a time, paged 8; after a 20-token prefill
    both hold tokens 0..15 quantized until the dense one flushes again at 24 tokens."""
    model = get_model("llama")
    ours, ref = paged(model, group_size=4, window=4), dense(model, group_size=4, window=4)
    prompt = make_prompt(20, seed=6)
    assert torch.equal(step(model, ours, prompt), step(model, ref, prompt))  # prefill attends at full precision
    for token in (5, 6, 7):
        torch.testing.assert_close(step(model, ours, [[token]]), step(model, ref, [[token]]), atol=1e-5, rtol=1e-5)
        assert [s.length for s in segments(ours)] == [s.length for s in segments(ref)] == [16] * 3
    for layer_ours, layer_ref in zip(ours.layers, ref.layers, strict=True):
        k, v = layer_ours.storage.segment.dequantized(0, 16, torch.float32)
        k_ref, v_ref = layer_ref.storage.segment.dequantized(0, 16, torch.float32)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    step(model, ours, [[8]]), step(model, ref, [[8]])
    assert segments(ref)[0].length == 20 and segments(ours)[0].length == 16  # units differ from here on


def test_stored_blocks_are_the_quantized_keys_of_the_model():
    """What the blocks hold is quantize -> dequantize of the exact keys (one block = two key groups)."""
    model = get_model("llama")
    cache = paged(model, bits=4, group_size=4, window=4)
    exact = DynamicCache(config=model.config)
    prompt = make_prompt(27, seed=7)
    step(model, cache, prompt), step(model, exact, prompt)
    fmt = QuantFormat(4, 4)
    for ours, theirs in zip(cache.layers, exact.layers, strict=True):
        stored_k, _ = ours.storage.segment.dequantized(0, 16, torch.float32)
        expected = dequantize_keys(*quantize_keys(theirs.keys[:, :, :16], fmt), fmt)
        assert torch.equal(stored_k, expected)
        torch.testing.assert_close(ours.keys, torch.cat([expected, theirs.keys[:, :, 16:]], dim=2))


def test_crop_into_a_block_frees_it_and_keeps_its_head_dequantized():
    """Rolling back to 20 of 30 tokens cuts the third block: its first 4 tokens return to the window (dequantized,
    the values they had), the block is freed, and the next step sees what the dense cache (groups of 4) sees."""
    model = get_model("llama")
    ours, ref = paged(model, group_size=4, window=4), dense(model, group_size=4, window=4)
    prompt = make_prompt(30, seed=16)
    step(model, ours, prompt), step(model, ref, prompt)
    assert ours.block_pools()["full"].num_used == 3
    ours.crop(-10), ref.crop(-10)
    assert ours.block_pools()["full"].num_used == 2
    assert [(layer.storage.segment.length, layer.storage.recent.length) for layer in ours.layers] == [(16, 4)] * 3
    torch.testing.assert_close(step(model, ours, [[7]]), step(model, ref, [[7]]), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- fused == dense
@pytest.mark.parametrize("bits", [8, 2])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_decode_over_the_blocks_matches_the_eager_dense_path(arch, bits):
    model = get_model(arch)
    prompt = make_prompt(37, seed=3)
    logits = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        try:
            cache = paged(model, bits=bits, group_size=4, window=4)
            logits[impl] = generate(model, cache, prompt, max_new_tokens=8)[1]
        finally:
            model.set_attn_implementation("sdpa")
        assert cache.layers[-1].in_place == (impl == "sdpa")
        assert any(s.length for s in segments(cache))
    torch.testing.assert_close(logits["sdpa"], logits["eager"], atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- rows share blocks
def test_beam_search_shares_the_prompt_blocks_and_matches_the_dense_cache():
    model = get_model("llama")
    prompt = make_prompt(30, seed=8)
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=10, output_scores=True)
    ours = paged(model)
    seq, logits = generate(model, ours, prompt, **kwargs)
    ref_seq, ref_logits = generate(model, dense(model), prompt, **kwargs)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    group = ours.groups["full"]
    rows, columns = group.batch_size, len(group.tables[0])
    assert rows == 3 and columns == 3  # 39 seen, 8+ exact: 3 blocks of 8 per beam
    assert group.blocks_in_use() < rows * columns  # the 3 prompt blocks are held once


def test_rows_of_one_prompt_share_blocks_first_filled_by_a_decode_step():
    """A prompt shorter than window + block: the first block fills while decoding and holds only the prompt's
    tokens, so rows of one prompt share it (which rows are equal was read at the prompt: the decode step that
    fills the block compares nothing)."""
    model = get_model("llama")
    ours, ref = paged(model), dense(model)
    prompt = make_prompt(12, seed=8).repeat(3, 1)
    step(model, ours, prompt), step(model, ref, prompt)
    group = ours.groups["full"]
    for token in range(5):  # the fourth step fills the first block (tokens 0..7)
        rows = [[3 + token]] * 3
        torch.testing.assert_close(step(model, ours, rows), step(model, ref, rows), atol=1e-5, rtol=1e-5)
    assert group.batch_size == 3 and len(group.tables[0]) == 1
    assert group.blocks_in_use() == 1


def test_fanned_out_rows_share_blocks_until_they_fill_their_own():
    model = get_model("llama")
    ours, ref = paged(model), dense(model)
    prompt = make_prompt(27, seed=9)
    step(model, ours, prompt), step(model, ref, prompt)
    ours.batch_repeat_interleave(3), ref.batch_repeat_interleave(3)
    group = ours.groups["full"]
    assert group.batch_size == 3 and group.blocks_in_use() == 2  # 16 quantized tokens, shared by 3 rows
    assert ours.layers[0].storage.recent.batch_size == 3
    for token in range(14):  # the window fills a block twice
        rows = [[3 + token], [40 + token], [80 + token]]
        torch.testing.assert_close(step(model, ours, rows), step(model, ref, rows), atol=1e-5, rtol=1e-5)
    assert len(group.tables[0]) == 4 and group.blocks_in_use() == 2 + 3 * 2  # each row quantized its own tokens
    ours.batch_select_indices(torch.tensor([2, 0])), ref.batch_select_indices(torch.tensor([2, 0]))
    assert group.blocks_in_use() == 2 + 2 * 2
    torch.testing.assert_close(step(model, ours, [[9], [10]]), step(model, ref, [[9], [10]]), atol=1e-5, rtol=1e-5)


def test_a_released_cache_leaves_a_shared_pool_as_it_was():
    model = get_model("llama")
    pool = PagedPool(model.config, bits=8, group_size=8, block_size=8)
    generate(model, PagedCache(model.config, pool=pool, window=8), make_prompt(30), max_new_tokens=2)
    before = pool.blocks["full"].num_free
    cache = PagedCache(model.config, pool=pool, window=8)
    generate(model, cache, make_prompt(33, seed=2), num_beams=2, max_new_tokens=6)
    assert pool.blocks["full"].num_free < before
    del cache
    gc.collect()
    assert pool.blocks["full"].num_free == before
    pool.blocks["full"].check()


# ---------------------------------------------------------------------------------------- windows free the blocks
def test_sliding_layers_free_their_blocks_as_the_window_slides():
    """Mistral with a window of 24: each step drops the oldest token; a block goes back once all of it left."""
    config = make_config("mistral")
    config.sliding_window = 24
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MistralForCausalLM(config).eval()
    ours, ref = paged(model), dense(model)
    prompt = make_prompt(30, seed=10)
    step(model, ours, prompt), step(model, ref, prompt)
    blocks = ours.block_pools()["sliding:24"]
    used = []
    for token in range(40):
        torch.testing.assert_close(step(model, ours, [[3 + token]]), step(model, ref, [[3 + token]]),
                                   atol=1e-5, rtol=1e-5)
        used.append(blocks.num_used)
    assert max(used) <= 3  # 23 tokens held, 8+ of them exact: at most 2 full blocks and one being left
    assert ours.memory_report().tokens_held == 23 and ours.get_seq_length() == 70
    assert blocks.capacity <= 8  # never grew: blocks were reused
    blocks.check()


def test_hybrid_gemma3_frees_the_sliding_blocks_and_keeps_the_full_ones():
    model = get_model("gemma3")  # sliding layers of 8, one full layer
    cache = paged(model, group_size=4, window=4)
    step(model, cache, make_prompt(40, seed=11))
    pools = cache.block_pools()
    assert pools["sliding:8"].num_used == 4 * 1  # quantized at prefill, attended, then dropped (freed next step)
    for token in range(3):
        step(model, cache, [[5 + token]])
    assert pools["sliding:8"].num_used == 0 and pools["full"].num_used == 4  # 43 seen, 32 quantized
    report = cache.memory_report()
    assert report.tokens_seen == 43 and report.tokens_held == 43


# ------------------------------------------------------------------------------------------------ limits and bytes
def test_a_fixed_pool_that_runs_out_raises_and_the_cache_stays_as_it_was():
    model = get_model("llama")
    cache = paged(model, group_size=4, window=4, num_blocks=3)
    twin = paged(model, group_size=4, window=4)
    prompt = make_prompt(30, seed=12)
    step(model, cache, prompt), step(model, twin, prompt)  # 24 quantized: the 3 blocks
    with pytest.raises(CapacityError, match=r"needs 1 blocks?, 0 free of 3"):
        step(model, cache, [[5, 6, 7, 8, 9, 10, 11, 12]])  # 14 in the window: a 4th block
    assert cache.get_seq_length() == 30
    assert [layer.storage.recent.length for layer in cache.layers] == [6] * 3
    cache.block_pools()["full"].check()
    torch.testing.assert_close(step(model, cache, [[5]]), step(model, twin, [[5]]), atol=1e-6, rtol=1e-6)
    cache.reset()
    assert cache.block_pools()["full"].num_free == 3


@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
def test_bytes_at_rest_per_quantized_token_follow_the_format(bits):
    model = get_model("llama")  # 3 layers, 2 KV heads, head_dim 16
    cache = paged(model, bits=bits, group_size=4, window=4)
    step(model, cache, make_prompt(45, seed=13, batch=2))  # 40 quantized tokens per row: 5 blocks each
    config, layers = model.config, 3
    fmt, head_dim, heads = QuantFormat(bits, 4), 16, config.num_key_value_heads
    tables = 2 * 5 * 4  # int32 block tables of the one group
    quantized = sum((s.memory().payload_bytes + s.memory().metadata_bytes) for s in segments(cache))
    assert quantized == layers * heads * 2 * 40 * fmt.bytes_per_token(head_dim) + tables
    window = sum(layer.storage.recent.memory().payload_bytes for layer in cache.layers)
    assert window == layers * 2 * 5 * 2 * heads * head_dim * 4  # 5 float32 tokens per row
    report = cache.memory_report()
    assert report.payload_bytes + report.metadata_bytes == quantized + window
    q = cache.quantized_report()
    assert q["quantized_tokens"] == 80 and q["format"] == str(fmt)
    params = 1 if bits == "fp8" else 2
    assert q["ratio_to_fp16"] == pytest.approx(fmt.code_bits / 16 + params / 4)


def test_a_memory_budget_counts_quantized_blocks():
    config = get_model("llama").config
    block = QuantLayerPool.bytes_per_block(QuantFormat(4, 4), 8, 2, 16)
    assert block == 2 * 8 * QuantFormat(4, 4).bytes_per_token(16)
    cache = PagedCache(config, bits=4, group_size=4, block_size=8, window=4, max_bytes=3 * 10 * block)
    assert cache.block_pools()["full"].capacity == 10
    with pytest.raises(ConfigError, match=r"less than one block of .* quantized int4/g4"):
        PagedCache(config, bits=4, group_size=4, block_size=8, window=4, max_bytes=100)


# ---------------------------------------------------------------------------------------------------- prefix reuse
def test_prefix_reuse_attaches_quantized_blocks_and_leaves_the_window_to_prefill():
    model = get_model("llama")
    pool = PagedPool(model.config, bits=8, group_size=4, block_size=8)
    first = make_prompt(30, seed=14)
    second = torch.cat([first[:, :27], make_prompt(6, seed=15)], dim=1)
    cache = PagedCache(model.config, pool=pool, window=4)
    cache.reuse_prefix(first)
    generate(model, cache, first, max_new_tokens=6)
    assert cache.store_prefix(first) == 3  # 35 seen, 24 quantized
    del cache
    reusing = PagedCache(model.config, pool=pool, window=4)
    assert reusing.reuse_prefix(second) == 24
    seq, logits = generate(model, reusing, second)
    fresh = PagedCache(model.config, pool=pool, window=4)
    fresh_seq, fresh_logits = generate(model, fresh, second)
    assert segments(reusing)[0].length == segments(fresh)[0].length  # the same tokens quantized
    torch.testing.assert_close(logits, fresh_logits, atol=0.15, rtol=0)  # the rest attends a dequantized prefix
    # A prompt that ends within the window of the stored blocks reuses only the blocks before it.
    short = PagedCache(model.config, pool=pool, window=4)
    assert short.reuse_prefix(first[:, :26]) == 16


# ----------------------------------------------------------------------------------------------------- bad settings
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(bits=3), ConfigError, "bits must be 8, 4, 2 or 'fp8'"),
        (dict(bits=8, group_size=6), ConfigError, "group_size 6 does not divide head_dim 16"),
        (dict(bits=8, group_size=16, block_size=8), ConfigError, "block_size 8 is not a multiple of group_size 16"),
        (dict(bits=8, group_size=4, window=2), ConfigError, r"window=2.*group_size=4"),
        (dict(bits=8, window=True), ConfigError, "window=True"),
        (dict(group_size=4), ConfigError, "group_size=4 needs bits"),
        (dict(bits=8, block_size=12), ConfigError, "power of two in 8..128, got 12"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        PagedCache(get_model("llama").config, **kwargs)


def test_a_pool_of_another_format_is_refused_and_a_pool_s_format_is_taken():
    config = get_model("llama").config
    lossless, int8 = PagedPool(config, block_size=8), PagedPool(config, bits=8, block_size=16)
    with pytest.raises(CacheMismatchError, match="holds full precision blocks; the cache asks for int8/g16"):
        PagedCache(config, pool=lossless, bits=8)
    with pytest.raises(CacheMismatchError, match="holds int8/g16 blocks; the cache asks for int4/g16"):
        PagedCache(config, pool=int8, bits=4)
    with pytest.raises(CacheMismatchError, match="int8/g16 blocks; the cache asks for int8/g8"):
        PagedCache(config, pool=PagedPool(config, bits=8, block_size=16), bits=8, group_size=8)
    assert PagedCache(config, pool=int8, window=16).format == QuantFormat(8, 16)
    assert PagedCache(config, pool=lossless).format is None
    with pytest.raises(UnsupportedOperationError, match="quantized_report needs a quantized PagedCache"):
        PagedCache(config, pool=lossless).quantized_report()
    other = make_config("mistral")
    with pytest.raises(CacheMismatchError, match="built for a llama"):
        PagedCache(other, pool=int8)


def test_default_block_size_holds_whole_groups():
    config = get_model("gemma3").config  # head_dim 32: int4's default group is 32
    cache = PagedCache(config, bits=4)
    assert cache.format == QuantFormat(4, 32) and cache.block_size == 32
    assert PagedCache(config, bits=8, group_size=8).block_size == 16
    assert PagedCache(config).block_size == 16 and PagedCache(config).format is None
