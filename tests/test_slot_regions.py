"""Precision regions in slot (evicting) storage and in paged quantized blocks: the first tokens of each row exact
beside the slots' codes, boundary layers at full precision or at their own bits, the spec options that reach them,
and the typed errors for sizes that cannot hold. (Compiled decode over a first-tokens region: the `first=` specs of
test_compile_static_graph, test_compile_fullgraph and test_decode_syncs.)"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import reference

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import ConfigError, H2OCache, PagedCache, SinkCache, SnapKVCache, UnsupportedOperationError
from hf_kvplus.attention.route import KV_READ_ATTR
from hf_kvplus.attention.slots import slot_decode
from hf_kvplus.errors import CacheMismatchError
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.paging.paged_pool import PagedPool
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.paged import PagedStorage
from hf_kvplus.storage.quantized import QuantizedStorage
from hf_kvplus.storage.slots import DenseCodec, SlotStore, TokenQuantCodec
from hf_kvplus.transformers_compat import cache_kwargs

FIRST = 4


def kv(batch, tokens, heads=2, dim=16):
    k, v = torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim)
    k[..., 3] *= 20  # an outlier channel: int4 codes are far from exact
    return k, v


def store(first=FIRST, fmt=None):
    return SlotStore(TokenQuantCodec(fmt or QuantFormat(4, 8)), scores=True, first=first)


@pytest.mark.parametrize("fmt", [QuantFormat(4, 8), "k4v2"])
def test_a_slot_store_holds_the_first_tokens_exact_and_codes_the_rest(fmt, seed):
    from hf_kvplus.formats import resolve_format
    from hf_kvplus.model_spec import ModelSpec

    if fmt == "k4v2":
        fmt = resolve_format(ModelSpec.from_config(get_model("llama").config), "k4v2", None)
    k, v = kv(2, 12)
    for first in (FIRST, 0):  # the region, and the control without it
        s = store(first, fmt)
        s.append(k[:, :, :2], v[:, :, :2])  # a prompt shorter than the region: decode steps fill the rest
        for t in range(2, 12):
            s.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        got_k, got_v = s.slots()
        exact = torch.equal(got_k[:, :, :FIRST], k[:, :, :FIRST]) and torch.equal(got_v[:, :, :FIRST], v[:, :, :FIRST])
        assert exact == bool(first), f"first={first}: the first tokens came back {'exact' if exact else 'coded'}"
        assert not torch.allclose(got_k[:, :, FIRST:], k[:, :, FIRST:], atol=1e-3), "the rest is coded"
        assert s.exact_part()[0] == first and s.quantized_part()[1] == 12 - first


def test_decode_reads_the_codes_then_the_exact_region(seed):
    s = store()
    k, v = kv(2, 20)
    s.append(k, v)
    # An eviction alike in every head (`uniform`: one mask per row): the region stays in slots 0..3.
    s.keep(torch.tensor([0, 1, 2, 3, 9, 12, 15, 19]).expand(2, 2, -1), uniform=True)
    s.append(*kv(2, 1))
    read = s.read(s.length, 1)
    assert read.residual_k is not None and read.keys.stride(-1) == 0, "decode must read the codes in place"
    assert read.decode_mask().tolist() == [[False] * 4 + [True] * 5 + [True] * 4] * 2
    q = torch.randn(2, 4, 1, 16)
    out, mass = slot_decode(q, read, 0.25, mass_queries=1)
    dense_k, dense_v = read.dense()
    assert torch.equal(dense_k[:, :, :FIRST], k[:, :, :FIRST])
    ref = reference(q[:, :, 0], dense_k, dense_v, 0.25)
    assert ((out[:, 0].double() - ref).norm() / ref.norm()).item() < 1e-5
    assert mass.shape == (2, 2, s.length)


def test_the_region_follows_rows_and_moves_with_the_store(seed):
    s = store()
    k, v = kv(2, 10)
    s.append(k, v)
    s.index_batch(torch.tensor([1, 1, 0]))
    assert torch.equal(s.slots()[0][:, :, :FIRST], k[[1, 1, 0], :, :FIRST])
    moved = {name: t.clone() for name, t in s.tensors().items()}  # what an offloading placement moves and brings back
    assert {"exact_k", "exact_v"} <= set(moved)
    s.load_tensors(moved)
    assert torch.equal(s.slots()[1][:, :, :FIRST], v[[1, 1, 0], :, :FIRST])
    s.drop_back(8)  # a roll-back into the region: position 2 no longer held, its entry masked
    s.append(*kv(3, 1))
    assert s.exact_mask()[:, -FIRST:].tolist() == [[True, True, True, False]] * 3


def llama():
    return get_model("llama")


def held_keys(cache, layer):
    """The keys attention reads from an evicting layer, densely, with the positions of their slots."""
    storage = cache.layers[layer].storage
    return storage.slots()[0], storage.used()["pos"]


def feed(cache, layers, keys, values, steps):
    """A prompt of the first `len - steps` tokens, then one-token steps, through update and attention."""
    n = keys.shape[2] - steps
    for layer in layers:
        for lo, hi in [(0, n)] + [(t, t + 1) for t in range(n, keys.shape[2])]:
            k, v = cache.update(keys[:, :, lo:hi], values[:, :, lo:hi], layer)
            q = torch.randn(keys.shape[0], 4, hi - lo, keys.shape[3])
            cache.layers[layer].attend(None, q, k, v, None, 0.25)


@pytest.mark.parametrize(
    "spec",
    [
        f"sink:{FIRST}:8:positions=original:bits=int4:group=8:first={FIRST}",
        f"sink:{FIRST}:8:positions=original:bits=k4v2:first={FIRST}",
        f"h2o:12:recent=4:bits=int4:group=8:first={FIRST}",
        f"h2o:12:recent=4:bits=int4:group=8:first={FIRST}:compile=on",
        f"snapkv:12:observation=4:bits=int4:group=8:first={FIRST}",
    ],
)
def test_evicting_caches_keep_the_first_tokens_exact_through_eviction(spec, seed):
    config = llama().config
    cache = parse_cache_spec(spec).build(config)
    assert all(layer.storage.first == FIRST for layer in cache.layers)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(2, 40, heads, dim)
    feed(cache, [0], k, v, steps=20)
    keys, pos = held_keys(cache, 0)
    for i in range(FIRST):  # every head still holds position i, exact
        at = (pos == i).int().argmax(-1, keepdim=True)
        assert (pos == i).any(-1).all(), f"{spec}: position {i} was evicted"
        got = keys.gather(2, at[..., None].expand(-1, -1, -1, dim))[:, :, 0]
        assert torch.equal(got, k[:, :, i]), f"{spec}: position {i} is not exact"
    later = (pos >= FIRST).int().argmax(-1, keepdim=True)
    got = keys.gather(2, later[..., None].expand(-1, -1, -1, dim))[:, :, 0]
    want = k.gather(2, pos.gather(2, later)[..., None].expand(-1, -1, -1, dim))[:, :, 0]
    assert not torch.allclose(got, want, atol=1e-3), "the other kept tokens are coded"


def test_moved_sinks_are_exact_too(seed):
    """With positions='cache' the sinks are re-rotated as the window slides: the region holds the re-rotated keys
    of the exact sinks, as a full-precision SinkCache does."""
    config = llama().config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(2, 30, heads, dim)
    caches = [SinkCache(config, num_sinks=FIRST, window=8), SinkCache(config, num_sinks=FIRST, window=8, bits=4,
                                                                      group_size=8, first_tokens=FIRST)]  # fmt: skip
    for cache in caches:
        feed(cache, [0], k, v, steps=10)
    full, region = (held_keys(cache, 0)[0][:, :, :FIRST] for cache in caches)
    assert not torch.equal(full, k[:, :, :FIRST]), "the sinks moved"
    torch.testing.assert_close(region, full, atol=1e-6, rtol=0)


def test_a_sink_cache_with_bits_keeps_its_sinks_exact_unless_told_first_0(seed):
    """The default region of a quantized SinkCache is its sinks (`first_tokens=None`, spec without `first=`); `first=0`
    codes them; without bits there is no region. The exact sinks move as a full-precision SinkCache's do, and every
    decode step's attention (the codes, with the sinks' slots masked, then the exact sinks: the mask kept between
    steps) is attention over the held tokens as the store reads them back."""
    config = llama().config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    built = {"full": SinkCache(config, num_sinks=FIRST, window=8),
             "default": SinkCache(config, num_sinks=FIRST, window=8, bits=4, group_size=8),
             "spec": parse_cache_spec(f"sink:{FIRST}:8:bits=int4:group=8").build(config),
             "coded": parse_cache_spec(f"sink:{FIRST}:8:bits=int4:group=8:first=0").build(config)}  # fmt: skip
    firsts = {name: {layer.storage.first for layer in cache.layers} for name, cache in built.items()}
    assert firsts == {"full": {0}, "default": {FIRST}, "spec": {FIRST}, "coded": {0}}
    k, v = kv(2, 30, heads, dim)
    for cache in built.values():
        feed(cache, [0], k[:, :, :20], v[:, :, :20], steps=6)
    sinks = {name: held_keys(cache, 0)[0][:, :, :FIRST] for name, cache in built.items()}
    torch.testing.assert_close(sinks["default"], sinks["full"], atol=1e-6, rtol=0)
    torch.testing.assert_close(sinks["spec"], sinks["full"], atol=1e-6, rtol=0)
    assert (sinks["coded"] - sinks["full"]).abs().max() > 1e-2, "first=0 codes the sinks"
    cache = built["default"]
    for t in range(20, 30):  # steady steps: the exact mask is made once, then kept
        keys, values = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        q = torch.randn(2, 4, 1, dim)
        dense_k, dense_v = cache.layers[0].storage.slots()  # (what the step attends to: it evicts after)
        out = cache.layers[0].attend(None, q, keys, values, None, 0.25)
        ref = reference(q[:, :, 0], dense_k, dense_v, 0.25)
        torch.testing.assert_close(out[:, 0].double(), ref, atol=1e-4, rtol=1e-4)


def test_bits_per_coordinate_count_the_exact_region():
    config = llama().config  # float32
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(1, 30, heads, dim)
    reports = []
    for first in (0, FIRST):
        cache = H2OCache(config, budget=12, recent=4, bits=4, group_size=8, first_tokens=first)
        feed(cache, range(config.num_hidden_layers), k, v, steps=5)
        reports.append(cache.quantized_report())
    # int4 per token over groups of 8 channels, float16 scale and zero: 4 + 2 * 16 / 8 = 8 bits; 12 tokens held
    assert reports[0]["bits_per_coordinate"] == pytest.approx(8.0)
    assert reports[1]["bits_per_coordinate"] == pytest.approx((8 * 8 + FIRST * 32) / 12)
    assert reports[1]["quantized_tokens"] == 12 - FIRST


def test_evicting_boundary_layers_at_full_precision_or_their_bits(seed):
    config = llama().config
    n = config.num_hidden_layers
    cache = parse_cache_spec("h2o:12:recent=4:bits=int2:group=8:boundary=1").build(config)
    assert [type(layer.storage.codec) for layer in cache.layers] == [DenseCodec] + [TokenQuantCodec] * (n - 2) + [DenseCodec]
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(1, 12, heads, dim)
    feed(cache, [0, 1], k, v, steps=2)
    assert torch.equal(held_keys(cache, 0)[0], k)
    assert not torch.allclose(held_keys(cache, 1)[0], k, atol=1e-3)
    cache = parse_cache_spec("sink:4:8:bits=int2:group=8:boundary=1:boundary_bits=int8:first=2").build(config)
    assert [layer.storage.codec.fmt.bits for layer in cache.layers] == [8] + [2] * (n - 2) + [8]
    assert cache.regions.first == 2 and cache.regions.boundary == 1


def test_paged_quantized_boundary_layers(seed):
    config = llama().config
    n = config.num_hidden_layers
    cache = parse_cache_spec("paged-quantized:int4:group=4:window=8:block=8:boundary=1").build(config)
    assert [type(layer.storage) for layer in cache.layers] == [PagedStorage] + [QuantizedStorage] * (n - 2) + [PagedStorage]
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(1, 40, heads, dim)
    got = {}
    for layer in (n - 1, 1):  # a prompt, then a decode step, which reads what the prompt left in blocks
        for lo, hi in ((0, 39), (39, 40)):
            keys, values = cache.update(k[:, :, lo:hi], v[:, :, lo:hi], layer)
            got[layer] = getattr(keys, KV_READ_ATTR).dense()[0]
            cache.layers[layer].attend(None, torch.randn(1, heads, hi - lo, dim), keys, values, None, 0.25)
    assert torch.equal(got[n - 1], k), "a boundary layer's blocks are full precision"
    assert not torch.equal(got[1], k)
    bits = parse_cache_spec("paged-quantized:int2:group=4:window=8:block=8:boundary=1:boundary_bits=int8").build(config)
    assert [layer.storage.fmt.bits for layer in bits.layers] == [8] + [2] * (n - 2) + [8]
    with pytest.raises(UnsupportedOperationError, match="boundary_layers=1"):
        cache.reuse_prefix(torch.arange(40))
    report = cache.quantized_report()  # the last layer's 32 tokens past the window at float32, the middle's coded in
    # int4 groups of 4 (4 + 2 * 16 / 4 = 12 bits; its own 4 blocks, not the boundary layer's 5); layer 0 holds none
    assert report["bits_per_coordinate"] == pytest.approx((32 * 32 + 32 * 12) / (2 * 32))
    assert report["quantized_tokens"] == 32


def test_paged_quantized_boundary_layers_generate_with_beams():
    model = llama()
    ids = make_prompt(13, batch=1)
    cache = PagedCache(model.config, bits=4, group_size=4, window=8, block_size=8, boundary_layers=1)
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=12, num_beams=2, do_sample=False,
                             pad_token_id=0, disable_compile=True)  # fmt: skip
    assert out.shape == (2 - 1, 13 + 12)


def test_a_shared_pool_must_hold_the_boundary_formats():
    config = llama().config
    pool = PagedPool(config, bits=4, group_size=4, block_size=8)
    with pytest.raises(CacheMismatchError, match="layer_bits"):
        PagedCache(config, pool=pool, window=8, boundary_layers=1)
    pool = PagedPool(config, bits=4, group_size=4, block_size=8, layer_bits={0: None, 2: None})
    PagedCache(config, pool=pool, window=8, boundary_layers=1)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda c: SinkCache(c, num_sinks=4, window=8, bits=4, first_tokens=-1), "first must be an int >= 0"),
        (lambda c: SinkCache(c, num_sinks=4, window=8, bits=4, first_tokens=5), "first_tokens=5 exceeds num_sinks=4"),
        (lambda c: H2OCache(c, budget=16, recent=10, bits=4, first_tokens=7), r"budget - recent = 16 - 10 = 6"),
        (lambda c: SnapKVCache(c, budget=16, observation=8, bits=4, first_tokens=9), r"budget - observation = 16 - 8 = 8"),
        (lambda c: H2OCache(c, budget=16, first_tokens=2), "need bits"),
        (lambda c: H2OCache(c, budget=16, bits=4, boundary_bits=8), "needs boundary layers"),
        (lambda c: PagedCache(c, boundary_layers=1), "need bits"),
        (lambda c: SlotStore(first=-2), "first=-2"),
    ],
)
def test_bad_regions_are_refused(make, match):
    with pytest.raises(ConfigError, match=match):
        make(llama().config)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("sink:4:8:bits=int4:first=-1", "first .* must be >= 0"),
        ("sink:4:8:bits=int4:first=x", "first .* must be an integer"),
        ("h2o:16:bits=int4:boundary_bits=int3", "int3"),
        ("snapkv:16:bits=int4:layers=2", "unknown options"),
    ],
)
def test_bad_region_specs_are_refused(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_cache_spec(spec)


def test_a_rotated_slot_store_centres_its_keys_on_every_prompt_token(seed):
    """The key centre is the mean of the keys first coded: every token of the prompt, not only the first one that
    the slots' buffers are shaped from (that one is often the attention sink, the outlier the centre should not
    follow)."""
    from hf_kvplus.kernels.rotated_format import RotatedFormat

    fmt = RotatedFormat(4, 2)
    state = fmt.make_state()
    slots = SlotStore(TokenQuantCodec(fmt, state), scores=True)
    keys, values = kv(2, 24, dim=32)
    keys[:, :, 0] += 40.0  # a sink-like first token
    slots.append(keys, values)
    assert state.mu is not None
    torch.testing.assert_close(state.mu, keys.float().mean(dim=(0, 2)))
