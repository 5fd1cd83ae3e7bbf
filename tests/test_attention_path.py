"""hf_kvplus's attention path: routing, the "kvplus" implementation, and exactness on every mask shape."""

import pytest
import torch
from kernel_checks import reference
from transformers import AutoModelForCausalLM, DynamicCache

from conformance.models import ARCHITECTURES, PAD_TOKEN_ID, build_model, make_config
from hf_kvplus import ATTN_IMPLEMENTATION, DenseCache, KVLayer, cache_kwargs
from hf_kvplus.attention.route import attend, decode_mask, dense_attention
from hf_kvplus.storage.reads import DenseRead, PackedRead, PagedRead


@pytest.fixture
def attend_calls(monkeypatch):
    calls = []
    original = KVLayer.attend

    def spy(self, module, query, *args, **kwargs):
        calls.append((self.spec.index, query.shape[2]))
        return original(self, module, query, *args, **kwargs)

    monkeypatch.setattr(KVLayer, "attend", spy)
    return calls


def test_sdpa_model_routes_our_caches_to_our_attention(attend_calls):
    model = build_model("qwen2")
    assert model.config._attn_implementation == "sdpa"
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    model.generate(prompt, max_new_tokens=4, do_sample=False, **cache_kwargs(DenseCache(config=model.config)))
    layers = model.config.num_hidden_layers
    assert len(attend_calls) == 4 * layers  # one prefill + three decode steps, every layer
    assert [q for _, q in attend_calls] == [5] * layers + [1] * 3 * layers
    attend_calls.clear()
    model.generate(prompt, max_new_tokens=4, do_sample=False, **cache_kwargs(DynamicCache(config=model.config)))
    assert attend_calls == []


def test_kvplus_attn_implementation(attend_calls):
    config = make_config("llama")
    torch.manual_seed(0)
    sdpa_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    kvplus_model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION).eval()
    kvplus_model.load_state_dict(sdpa_model.state_dict())
    assert kvplus_model.config._attn_implementation == "kvplus"
    prompt = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    reference = sdpa_model.generate(prompt, **cache_kwargs(DynamicCache(config=config)), **kwargs)
    plain = kvplus_model.generate(prompt, **cache_kwargs(DynamicCache(config=config)), **kwargs)
    assert attend_calls == []
    for got, want in zip(plain.logits, reference.logits, strict=True):
        assert torch.equal(got, want)  # other caches under "kvplus" are plain SDPA
    ours = kvplus_model.generate(prompt, **cache_kwargs(DenseCache(config=config)), **kwargs)
    assert len(attend_calls) == 6 * config.num_hidden_layers
    assert torch.equal(ours.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(reference.logits), atol=1e-5, rtol=1e-5)


@pytest.fixture
def attn_model(request):
    """The shared tiny model of `arch`, switched to `attn` attention for the test and switched back after."""
    arch, attn = request.param
    model = build_model(arch)
    previous = model.config._attn_implementation
    model.config._attn_implementation = attn
    yield model
    model.config._attn_implementation = previous


@pytest.mark.parametrize(
    "attn_model", [(arch, attn) for arch in ARCHITECTURES for attn in ("sdpa", "eager")], indirect=True,
    ids=lambda p: "-".join(p),
)
def test_chunks_and_steps_through_the_cache_equal_one_cache_free_forward(attn_model):
    """Prefill, chunked prefill over a non-empty cache and decode, with left padding, past every window.

    Under sdpa this is hf_kvplus's attention path; under eager, the dense path (eager attention over the
    views `update` returns)."""
    model = attn_model
    tokens = torch.randint(3, 128, (3, 30), generator=torch.Generator().manual_seed(7), device="cpu").to(torch.get_default_device())
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0
    mask[2, :11] = 0
    tokens = tokens.masked_fill(mask == 0, PAD_TOKEN_ID)
    with torch.no_grad():
        reference = model(tokens, attention_mask=mask).logits
        cache, pieces, start = DenseCache(config=model.config), [], 0
        for size in [12, 1, 1, 5, 1, 9, 1]:
            end = start + size
            out = model(tokens[:, start:end], attention_mask=mask[:, :end], **cache_kwargs(cache), use_cache=True)
            pieces.append(out.logits)
            start = end
    assert start == tokens.shape[1] and cache.get_seq_length() == start
    got = torch.cat(pieces, dim=1)
    real = mask.bool()
    torch.testing.assert_close(got[real], reference[real], atol=1e-5, rtol=1e-5)


def test_decode_with_padding_and_window_masks_matches_float64():
    batch, heads, kv_heads, kv_len, dim = 3, 6, 2, 37, 16
    query = torch.randn(batch, heads, 1, dim)
    keys, values = torch.randn(batch, kv_heads, kv_len, dim), torch.randn(batch, kv_heads, kv_len, dim)
    mask = torch.ones(batch, kv_len, dtype=torch.bool)
    mask[1, :9] = False  # left padding
    mask[2, :-8] = False  # a sliding window of 8
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    out = torch.full((batch, 1, heads, dim), float("nan"))
    out[:] = dense_attention(module, query, keys, values, mask[:, None, None, :], dim**-0.5)
    want = reference(query[:, :, 0], keys, values, dim**-0.5, mask)[:, None]
    assert torch.isfinite(out).all()
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-6


def test_masks_the_decode_kernel_cannot_take_go_to_sdpa():
    assert decode_mask(None, 2) is None
    assert decode_mask(torch.zeros(2, 1, 1, 5), 2) is False  # additive float mask
    assert decode_mask(torch.ones(2, 4, 1, 5, dtype=torch.bool), 2) is False  # per-head mask
    assert decode_mask(torch.ones(1, 1, 1, 5, dtype=torch.bool), 3).shape == (3, 5)
    batch, heads, kv_heads, kv_len, dim = 2, 4, 2, 11, 8
    query = torch.randn(batch, heads, 1, dim)
    keys, values = torch.randn(batch, kv_heads, kv_len, dim), torch.randn(batch, kv_heads, kv_len, dim)
    bool_mask = torch.rand(batch, kv_len) > 0.3
    bool_mask[:, -1] = True
    float_mask = torch.zeros(batch, 1, 1, kv_len).masked_fill(~bool_mask[:, None, None, :], float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    out = dense_attention(module, query, keys, values, float_mask, dim**-0.5)
    want = reference(query[:, :, 0], keys, values, dim**-0.5, bool_mask)[:, None]
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-6


def _paged_and_packed_reads(keys, values):
    """The same tokens as a `PagedRead` and a `PackedRead` (int8, exact enough), both gathering `keys`/`values`."""
    from hf_kvplus.kernels.quant_format import QuantFormat
    from hf_kvplus.storage.packed_segment import PackedSegment
    from hf_kvplus.storage.quantized import QuantizedStorage

    batch, kv_heads, n, dim = keys.shape
    block = 4
    blocks = -(-n // block)
    k_pool = torch.zeros(batch * blocks, kv_heads, block, dim)
    v_pool = torch.zeros_like(k_pool)
    table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    for b in range(batch):
        for t in range(n):
            k_pool[table[b, t // block], :, t % block] = keys[b, :, t]
            v_pool[table[b, t // block], :, t % block] = values[b, :, t]
    ph = torch.full((), float("nan")).expand(keys.shape)
    paged = PagedRead(ph, ph, k_pool, v_pool, table, 0, n, lambda: (keys, values))
    storage = QuantizedStorage(PackedSegment(QuantFormat(8, 4)), window=4)
    storage.append(keys[:, :, :-1], values[:, :, :-1])
    storage.append(keys[:, :, -1:], values[:, :, -1:])
    packed = storage.read(n, 1)
    assert isinstance(packed, PackedRead)
    return paged, packed


@pytest.mark.parametrize("kind", ["dense", "paged", "packed"])
@pytest.mark.parametrize("extra", ["position_bias", "softcap", "s_aux", "dropout"])
def test_every_read_takes_sdpa_for_what_the_kernels_do_not_implement(monkeypatch, kind, extra):
    """One guard for every read: a call with a position bias, softcapping, sinks or dropout never reaches a
    decode kernel (they would silently ignore it); it gathers the read and goes to Transformers' SDPA."""
    from hf_kvplus.attention import route

    batch, heads, kv_heads, n, dim = 2, 4, 2, 9, 8
    keys, values = torch.randn(batch, kv_heads, n, dim), torch.randn(batch, kv_heads, n, dim)
    paged, packed = _paged_and_packed_reads(keys, values)
    read = {"dense": DenseRead(keys, values), "paged": paged, "packed": packed}[kind]
    query = torch.randn(batch, heads, 1, dim)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    module.training = False
    value = {"position_bias": torch.randn(batch, heads, 1, n), "softcap": 30.0, "s_aux": torch.zeros(heads), "dropout": 0.1}[extra]
    seen = []
    monkeypatch.setattr(route, "sdpa_attention_forward", lambda *a, **kw: (seen.append(a[2].shape) or torch.zeros(batch, 1, heads, dim), None))
    for name in ("decode_attention", "paged_decode_attention", "quantized_decode_attention"):
        monkeypatch.setattr(route, name, lambda *a, **kw: pytest.fail(f"a decode kernel was called with {extra}"))
    route.attend(read, module, query, None, dim**-0.5, **{extra: value})
    assert seen == [(batch, kv_heads, n, dim)]


@pytest.mark.parametrize("kind", ["paged", "packed"])
def test_in_place_reads_decode_like_the_dense_read(kind):
    batch, heads, kv_heads, n, dim = 2, 4, 2, 9, 8
    keys, values = torch.randn(batch, kv_heads, n, dim), torch.randn(batch, kv_heads, n, dim)
    paged, packed = _paged_and_packed_reads(keys, values)
    read = paged if kind == "paged" else packed
    query = torch.randn(batch, heads, 1, dim)
    mask = torch.ones(batch, 1, 1, n, dtype=torch.bool)
    mask[1, ..., :3] = False
    got, _ = attend(read, None, query, mask, dim**-0.5)
    want = reference(query[:, :, 0], keys, values, dim**-0.5, mask[:, 0, 0])[:, None]
    assert ((got.double() - want).norm() / want.norm()).item() < (1e-6 if kind == "paged" else 2e-2)
