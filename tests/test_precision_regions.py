"""Precision regions (`PrecisionRegions`): the first tokens of each row and boundary layers at full precision (or at
other bits), in every quantized storage that holds them; and the bits per coordinate that count them."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import reference

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import ConfigError, QuantizedCache, UnsupportedOperationError
from hf_kvplus.attention.route import KV_READ_ATTR, attend
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.quantized_cache import PRESET_FIRST_TOKENS
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.dense import DenseStorage
from hf_kvplus.storage.packed_segment import PackedSegment
from hf_kvplus.storage.quantized import QuantizedStorage
from hf_kvplus.storage.reads import PackedRead
from hf_kvplus.transformers_compat import cache_kwargs

FIRST, WINDOW = 4, 8


def kv(batch, tokens, heads=2, dim=16):
    k, v = torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim)
    k[..., 3] *= 20
    return k, v


def storage(first=FIRST):
    return QuantizedStorage(PackedSegment(QuantFormat(4, 4)), window=WINDOW, first=first)


@pytest.mark.parametrize("steps", [[30, 1, 1, 9, 1], [2, 1, 1, 1, 1, 1, 20, 1], [4, 40, 1]])
def test_the_first_tokens_stay_exact_and_in_order(steps, seed):
    s, keys, values = storage(), [], []
    for n in steps:
        k, v = kv(2, n)
        s.append(k, v)
        keys.append(k)
        values.append(v)
        all_k, all_v = torch.cat(keys, 2), torch.cat(values, 2)
        got_k, got_v = s.view(s.length)
        assert got_k.shape == all_k.shape
        head = min(FIRST, s.length)
        assert s.head == head
        assert torch.equal(got_k[:, :, :head], all_k[:, :, :head]), f"seed {seed}"
        assert torch.equal(got_v[:, :, :head], all_v[:, :, :head])
        window = min(WINDOW, s.length)
        assert torch.equal(got_k[:, :, -window:], all_k[:, :, -window:])
        assert s.segment.length == s.length - s.recent.length  # nothing of the head was quantized


def test_decode_reads_codes_then_head_and_window_and_masks_them_in_that_order(seed):
    s = storage()
    s.append(*kv(2, 30))
    s.append(*kv(2, 1))
    read = s.read(s.length, 1)
    assert isinstance(read, PackedRead) and read.keys.stride(-1) == 0, "decode must read the codes in place"
    assert read.recent_k.shape[2] == s.recent.length  # one residual: the head and the window
    dense_k, dense_v = s.view(s.length)
    assert all(torch.equal(a, b) for a, b in zip(read.dense(), (dense_k, dense_v), strict=True))
    q = torch.randn(2, 4, 1, 16)
    mask = torch.rand(2, 1, 1, s.length) > 0.3  # a mask in token order: the read reorders it
    mask[..., -1] = True
    out, _ = attend(read, None, q, mask, 0.25)
    ref = reference(q[:, :, 0], dense_k, dense_v, 0.25, mask=mask[:, 0, 0])
    assert ((out[:, 0].double() - ref).norm() / ref.norm()).item() < 1e-5


def test_drop_and_rollback_through_the_head(seed):
    s = storage()
    k, v = kv(1, 33)
    s.append(k, v)
    held = s.view(s.length)[0].clone()
    s.drop_back(s.recent.length - s.head + 5)  # through the window into the codes, mid-group
    assert torch.allclose(s.view(s.length)[0], held[:, :, : s.length], atol=1e-6)
    assert torch.equal(s.view(s.length)[0][:, :, :FIRST], k[:, :, :FIRST])
    s.drop_back(s.length - 2)  # through every code into the head
    assert s.head == 2 and s.segment.length == 0 and torch.equal(s.view(2)[0], k[:, :, :2])
    k2, v2 = kv(1, 30)
    s.append(k2, v2)  # the head takes the first tokens again
    assert s.head == FIRST and torch.equal(s.view(s.length)[0][:, :, 2:FIRST], k2[:, :, :2])
    s.drop_front(3)  # the oldest first: the head
    assert s.head == 1 and torch.equal(s.view(s.length)[0][:, :, :1], k2[:, :, 1:2])
    s.index_batch(torch.tensor([0, 0]))
    assert s.head == 1 and s.batch_size == 2


SPECS = [
    f"quantized:int4:group=4:window={WINDOW}:first={FIRST}",
    f"quantized:int4:group=4:window={WINDOW}:first={FIRST}:backend=quanto",
    f"quantized:k4v2:window={WINDOW}:first={FIRST}",
    f"paged-quantized:int4:group=4:window={WINDOW}:block=8:first={FIRST}",
    f"offloaded-quantized:int4:group=4:window={WINDOW}:first={FIRST}",
    f"quantized:int4:group=4:window={WINDOW}:first={FIRST}:max_tokens=96",
    f"quantized:k4v2:window={WINDOW}:first={FIRST}:max_tokens=96",
]


def seen_by_attention(cache, layer, keys, values):
    """The keys attention gets from `layer` for this forward, densely in token order."""
    k, v = cache.update(keys, values, layer)
    read = getattr(k, KV_READ_ATTR, None)
    cache.layers[layer].attend(None, torch.randn(keys.shape[0], keys.shape[1], keys.shape[2], keys.shape[3]), k, v,
                               None, 1.0)  # fmt: skip
    return read.dense()[0] if read is not None else k


@pytest.mark.parametrize("spec", SPECS)
def test_every_quantized_storage_holds_a_first_tokens_region(spec, seed):
    if "quanto" in spec:
        pytest.importorskip("optimum.quanto")
    config = get_model("llama").config
    cache = parse_cache_spec(spec).build(config)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(2, 60, heads, dim)
    seen_by_attention(cache, 0, k[:, :, :40], v[:, :, :40])
    for t in range(40, 60):  # decode steps: the kernel's path
        got = seen_by_attention(cache, 0, k[:, :, t : t + 1], v[:, :, t : t + 1])
    # (a static rotated storage holds exact tokens rotated, in the model's dtype: one rounding each way)
    tol = 1e-5 if "k4v2" in spec and "max_tokens" in spec else 0.0
    assert torch.allclose(got[:, :, :FIRST], k[:, :, :FIRST], atol=tol, rtol=0), "the first tokens were quantized"
    assert not torch.allclose(got[:, :, FIRST : FIRST + 8], k[:, :, FIRST : FIRST + 8], atol=1e-3), "nothing was"


@pytest.mark.parametrize("spec", [f"quantized:int4:group=4:window={WINDOW}:boundary=1",
                                  f"offloaded-quantized:int4:group=4:window={WINDOW}:boundary=1"])  # fmt: skip
def test_boundary_layers_are_held_at_full_precision(spec, seed):
    config = get_model("llama").config
    cache = parse_cache_spec(spec).build(config)
    n = config.num_hidden_layers
    assert [type(layer.storage) for layer in cache.layers] == [DenseStorage] + [QuantizedStorage] * (n - 2) + [DenseStorage]
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(1, 40, heads, dim)
    got = {}
    for layer in (n - 1, 1):  # a prompt, then a decode step, which reads what the prompt left coded
        seen_by_attention(cache, layer, k[:, :, :39], v[:, :, :39])
        got[layer] = seen_by_attention(cache, layer, k[:, :, 39:], v[:, :, 39:])
    assert torch.equal(got[n - 1], k)
    assert not torch.equal(got[1], k)


def test_boundary_layers_at_other_bits():
    config = get_model("llama").config
    cache = QuantizedCache(config, bits=2, group_size=4, window=16, boundary_layers=1, boundary_bits=8)
    bits = [layer.storage.fmt.bits for layer in cache.layers]
    assert bits == [8] + [2] * (config.num_hidden_layers - 2) + [8]


def test_bits_per_coordinate_count_the_full_precision_regions():
    config = get_model("llama").config  # float32, 3 layers
    heads, dim, layers = config.num_key_value_heads, config.hidden_size // config.num_attention_heads, 3
    assert config.num_hidden_layers == layers
    plain = QuantizedCache(config, bits=4, group_size=4, window=WINDOW)
    regions = QuantizedCache(config, bits=4, group_size=4, window=WINDOW, first_tokens=FIRST, boundary_layers=1)
    k, v = kv(1, 40, heads, dim)
    for cache in (plain, regions):
        for layer in range(layers):
            cache.update(k, v, layer)
    # int4 with groups of 4 tokens (keys) and 4 channels (values), float16 scale and zero per group: 4 + 2*16/4 = 12
    assert plain.quantized_report()["bits_per_coordinate"] == pytest.approx(12.0)
    # Outside the window: 32 tokens per layer. The middle layer holds 4 of them at float32 and 28 coded (at 12 bits);
    # the two boundary layers hold all 32 at float32.
    want = (28 * 12 + 4 * 32 + 2 * 32 * 32) / (3 * 32)
    assert regions.quantized_report()["bits_per_coordinate"] == pytest.approx(want)


def test_bad_regions_are_refused():
    config = get_model("llama").config
    with pytest.raises(ConfigError, match="first must be an int >= 0"):
        QuantizedCache(config, bits=4, first_tokens=-1)
    with pytest.raises(ConfigError, match="0..max_tokens-1, got 64"):
        QuantizedCache(config, bits=4, max_tokens=64, first_tokens=64)
    with pytest.raises(ConfigError, match="needs boundary layers"):
        QuantizedCache(config, bits=4, boundary_bits=8)


def test_a_static_storage_with_a_head_decodes_as_the_growing_one():
    """The same tokens coded in the same groups, the same first tokens exact: the same logits up to the order of
    sums, through a left-padded generate whose steps fill, quantize and read the head's neighbours."""
    model = get_model("llama")
    ids = make_prompt(13, batch=2)  # fixed, as test_static_quantized's twin: on these chaotic models one code that
    # rounds the other way (sums in another order) moves logits by more than the bound
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    outs, caches = [], []
    for max_tokens in (None, 48):
        cache = QuantizedCache(model.config, bits=4, group_size=4, window=4, first_tokens=FIRST, max_tokens=max_tokens)
        caches.append(cache)
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=30,
                                       do_sample=False, pad_token_id=0, output_scores=True,
                                       return_dict_in_generate=True, disable_compile=True))  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert caches[0].quantized_report() == caches[1].quantized_report()  # the head counted in both (groups of 4)
    for a, b in zip(outs[0].scores, outs[1].scores, strict=True):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=0)


def test_paged_prefix_reuse_refuses_a_first_tokens_region():
    cache = parse_cache_spec(f"paged-quantized:int4:group=4:window={WINDOW}:block=8:first={FIRST}").build(
        get_model("llama").config
    )
    with pytest.raises(UnsupportedOperationError, match="first_tokens=4"):
        cache.reuse_prefix(torch.arange(40))


PRESETS = ["quantized:k4v2", "quantized:k3v2", "quantized:k2v2", "offloaded-quantized:k4v2"]


@pytest.mark.parametrize("spec", PRESETS)
def test_a_rotated_preset_keeps_its_first_tokens_exact_unless_first_is_0(spec, seed):
    config = get_model("llama").config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    k, v = kv(1, 40, heads, dim)
    got = {}
    for text in (f"{spec}:window={WINDOW}", f"{spec}:window={WINDOW}:first=0"):
        cache = parse_cache_spec(text).build(config)
        seen_by_attention(cache, 0, k[:, :, :39], v[:, :, :39])
        got[text] = seen_by_attention(cache, 0, k[:, :, 39:], v[:, :, 39:])  # a decode step reads the codes
        first = PRESET_FIRST_TOKENS[spec.split(":")[1]] if "first=0" not in text else 0
        assert [layer.storage.first for layer in cache.layers] == [first] * config.num_hidden_layers
    preset, off = got.values()
    assert PRESET_FIRST_TOKENS[spec.split(":")[1]] == 4
    assert torch.equal(preset[:, :, :4], k[:, :, :4]), "the preset's first tokens were quantized"
    assert not torch.allclose(off[:, :, :4], k[:, :, :4], atol=1e-3), "first=0 kept them exact"
    assert not torch.allclose(preset[:, :, 4:12], k[:, :, 4:12], atol=1e-3), "the preset kept more than its tokens"


def test_the_preset_follows_the_format_and_gives_way_to_an_explicit_first():
    config = get_model("llama").config
    first = lambda **kw: QuantizedCache(config, window=WINDOW, **kw).regions.first  # noqa: E731
    assert first(key_bits=4, value_bits=2) == first(bits="k4v2") == 4  # the same preset by either name
    assert first(bits="k2v2", first_tokens=0) == 0 and first(bits="k3v2", first_tokens=9) == 9
    assert first(bits=4, group_size=4) == first(bits="k4v4") == first(bits="k8v8") == 0  # no preset measured there


@pytest.mark.parametrize("bits, key_bits, value_bits", [("k4v2", 4, 2), ("k3v2", 3, 2), ("k2v2", 2, 2)])
def test_a_presets_bits_per_coordinate_are_its_storage(bits, key_bits, value_bits):
    """The report against the storage's own counts: per layer, `head` exact float32 tokens and `segment.length`
    coded ones (key and value codes plus one float16 norm each per head vector), over every token past the window."""
    config = get_model("llama").config  # float32, 3 layers, 2 KV heads
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    cache = QuantizedCache(config, bits=bits, window=WINDOW)
    k, v = kv(1, 40, heads, dim)
    for layer in range(config.num_hidden_layers):
        cache.update(k, v, layer)
    coded_bits = exact_bits = coordinates = 0
    for layer in cache.layers:
        s = layer.storage
        assert s.head == 4 and s.segment.length > 0 and s.segment.length + s.recent.length == 40  # recent: head too
        coded_bits += s.segment.length * heads * ((key_bits + value_bits) * dim + 2 * 16)
        exact_bits += s.head * heads * 2 * dim * 32
        coordinates += (s.head + s.segment.length) * heads * 2 * dim
    report = cache.quantized_report()
    assert report["bits_per_coordinate"] == pytest.approx((coded_bits + exact_bits) / coordinates, rel=1e-12)
    assert report["bits_per_coordinate"] > (key_bits + value_bits) / 2 + 16 / dim  # the exact tokens counted
    assert report["quantized_bytes"] * 8 == coded_bits
