"""Evicting caches on models: sink re-rotation against keys rotated from scratch, left padding against
rows run alone, bounded memory, and refusals."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conformance.models import get_model
from conformance.modes import left_padded_batch, make_prompt
from hf_kvplus import (
    ConfigError,
    H2OCache,
    SinkCache,
    SnapKVCache,
    UnsupportedModelError,
    UnsupportedOperationError,
    cache_kwargs,
)
from hf_kvplus.attention import route
from hf_kvplus.eviction import RotaryShift
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.storage.reads import SlotRead
from hf_kvplus.storage.slots import SlotStore, TokenQuantCodec

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def rope_config(rope, **kwargs):
    return LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=1,
                       vocab_size=32, intermediate_size=32, max_position_embeddings=256, rope_parameters=dict(rope),
                       **kwargs)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_shift_equals_rotation_from_scratch_at_the_new_position(rope, seed):
    config = rope_config(ROPES[rope])
    embedding = LlamaRotaryEmbedding(config)
    raw = torch.randn(3, 1, 5, 64)
    start = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [100, 101, 102, 103, 104]])
    shift = torch.tensor([0, 13, 90])

    def rotated(positions):
        cos, sin = embedding(raw, positions)
        # attention_scaling multiplies cos and sin; take it out to compare pure rotations.
        return apply_rotary_pos_emb(raw, raw, cos / embedding.attention_scaling, sin / embedding.attention_scaling)[1]

    moved = RotaryShift.from_config(config).rotate(rotated(start), shift)
    # Two float32 rotations against one, at angles up to 194 radians: over 300 seeds the worst excess over
    # rtol was 2.3e-5 (yarn), so 2e-5 failed about one run in a hundred.
    torch.testing.assert_close(moved, rotated(start + shift[:, None]), atol=5e-5, rtol=1e-5)


def test_partial_rotary_leaves_the_other_channels_alone(seed):
    config = rope_config({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    shift = RotaryShift.from_config(config)
    assert shift.rotary_dim == 32
    keys = torch.randn(2, 1, 3, 64)
    moved = shift.rotate(keys, torch.tensor([5, 9]))
    assert torch.equal(moved[..., 32:], keys[..., 32:])
    assert not torch.allclose(moved[..., :32], keys[..., :32])


def test_sink_keys_equal_keys_rotated_from_scratch_at_their_cache_position(seed):
    model = get_model("llama")
    num_sinks, window = 2, 6
    cache = SinkCache(model.config, num_sinks=num_sinks, window=window)
    ids = make_prompt(30)
    with torch.no_grad():
        model(ids[:, :12], **cache_kwargs(cache))
        for t in range(12, 30):
            model(ids[:, t : t + 1], **cache_kwargs(cache))
    # Layer 0 keys depend on the token and its position only: recompute the sinks' from scratch.
    layer = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[:, :num_sinks]))
    raw = layer.k_proj(hidden).view(1, num_sinks, -1, layer.head_dim).transpose(1, 2)
    evicted = 30 - (num_sinks + window)
    cos, sin = model.model.rotary_emb(raw, torch.arange(num_sinks)[None] + evicted)
    expected = apply_rotary_pos_emb(raw, raw, cos, sin)[1]
    store = cache.layers[0].storage
    slots = [store.positions[0, 0].tolist().index(i) for i in range(num_sinks)]
    torch.testing.assert_close(store.slots()[0][:, :, slots], expected, atol=1e-5, rtol=1e-5)
    # The window keys keep their original rotation: their distance to the query is already right.
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kwargs(dense))
    newest = store.positions[0, 0].tolist().index(29)
    torch.testing.assert_close(store.slots()[0][:, :, newest], dense.layers[0].keys[:, :, 29], atol=1e-5, rtol=1e-5)


EVICTING = {
    "sink": lambda config: SinkCache(config, num_sinks=2, window=5),
    "sink-original": lambda config: SinkCache(config, num_sinks=2, window=5, positions="original"),
    "h2o": lambda config: H2OCache(config, budget=6, recent=2),
    "snapkv": lambda config: SnapKVCache(config, budget=6, observation=2, kernel_size=3),
}


@pytest.mark.parametrize("name", sorted(EVICTING))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_left_padded_row_matches_the_row_run_alone(name, arch):
    model = get_model(arch)
    ids, mask = left_padded_batch()
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    batched = model.generate(ids, attention_mask=mask, **cache_kwargs(EVICTING[name](model.config)), **kwargs)
    for row in range(ids.shape[0]):
        real = ids[row : row + 1, ~mask[row].logical_not()]
        alone = model.generate(real, **cache_kwargs(EVICTING[name](model.config)), **kwargs)
        assert torch.equal(batched.sequences[row, ids.shape[1] :], alone.sequences[0, real.shape[1] :]), f"row {row}"
        for step, (got, want) in enumerate(zip(batched.logits, alone.logits, strict=True)):
            torch.testing.assert_close(got[row], want[0], atol=1e-4, rtol=1e-4, msg=f"row {row} step {step}")


@pytest.mark.parametrize("name", ["sink", "h2o"])
def test_memory_stays_constant_as_the_sequence_grows(name):
    model = get_model("llama")
    cache = EVICTING[name](model.config)
    sizes = {}
    with torch.no_grad():
        model(make_prompt(40), **cache_kwargs(cache))
        for t in range(200):
            model(make_prompt(1, seed=t), **cache_kwargs(cache))
            if t in (20, 199):
                sizes[t] = cache.memory_report()
    assert sizes[20].total_bytes == sizes[199].total_bytes
    assert sizes[199].tokens_seen == 240
    assert sizes[199].tokens_held == (7 if name == "sink" else 6)


def test_only_policies_that_rank_by_attention_keep_a_score_per_slot():
    """StreamingLLM evicts by position: its slots hold a position each and no score (4 bytes per slot and head
    less, and no score to zero in a decode step); H2O's hold both."""
    model = get_model("llama")
    per_slot = {}
    for name, cache in (("sink", SinkCache(model.config, num_sinks=2, window=30)), ("h2o", H2OCache(model.config, budget=32))):
        with torch.no_grad():
            model(make_prompt(40), **cache_kwargs(cache))
            model(make_prompt(1), **cache_kwargs(cache))
        store = cache.layers[0].storage
        per_slot[name] = store.memory().metadata_bytes // (store.batch_size * store.pos.shape[1] * store.capacity)
        assert ("score" in store.fields) == (name == "h2o")
    assert per_slot == {"sink": 8, "h2o": 12}  # an int64 position, and a float32 score where ranked


def test_snapkv_memory_is_bounded_in_the_prompt_length():
    model = get_model("llama")
    held = []
    for length in (40, 160):
        cache = SnapKVCache(model.config, budget=16, observation=4)
        with torch.no_grad():
            model(make_prompt(length), **cache_kwargs(cache))
        held.append((cache.memory_report().tokens_held, cache.memory_report().total_bytes))
    assert held[0] == held[1] and held[0][0] == 16


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda c: SinkCache(c, window=0), "at least 1 token, got window=0"),
        (lambda c: SinkCache(c, num_sinks=-1), "num_sinks must be >= 0, got num_sinks=-1"),
        (lambda c: SinkCache(c, positions="absolute"), "positions must be one of"),
        (lambda c: H2OCache(c, budget=0), "budget=0"),
        (lambda c: H2OCache(c, budget=8, recent=9), "within 0..budget=8, got recent=9"),
        (lambda c: SnapKVCache(c, budget=32, observation=32), r"budget \(32\) must exceed the observation window \(32\)"),
        (lambda c: SnapKVCache(c, kernel_size=4), "positive odd number, got 4"),
        (lambda c: SnapKVCache(c, pooling="median"), "pooling must be one of"),
        (lambda c: SinkCache(c, group_size=8), "group_size=8 needs bits"),
        (lambda c: H2OCache(c, bits=3), "bits must be 8, 4, 2 or 'fp8'"),
    ],
)
def test_bad_budgets_are_refused_at_construction(build, match):
    with pytest.raises(ConfigError, match=match):
        build(get_model("llama").config)


def test_eager_attention_is_refused_at_construction_and_at_run_time():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         vocab_size=128, intermediate_size=64)
    config._attn_implementation = "eager"
    with pytest.raises(UnsupportedModelError, match="attn_implementation='eager'"):
        SinkCache(config)
    model = LlamaForCausalLM(config).eval()
    config._attn_implementation = "sdpa"
    cache = SinkCache(config, num_sinks=1, window=4)
    model.config._attn_implementation = "eager"
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="did not go through hf_kvplus"):
        model(make_prompt(6), **cache_kwargs(cache))
        model(make_prompt(1), **cache_kwargs(cache))


@pytest.mark.parametrize("cls, extra", [(H2OCache, {}), (SnapKVCache, {"observation": 4})])
def test_assisted_decoding_is_refused_before_it_starts(cls, extra):
    model = get_model("llama")
    with pytest.raises(UnsupportedOperationError, match="cannot roll tokens back"):
        model.generate(make_prompt(6), **cache_kwargs(cls(model.config, budget=16, **extra)), max_new_tokens=4,
                       prompt_lookup_num_tokens=2, do_sample=False)


@pytest.mark.parametrize("bits, group", [(8, 16), (4, 16), (2, 8), ("fp8", 16)])
def test_quantized_slots_stay_within_the_format_bound(bits, group, seed):
    store = SlotStore(TokenQuantCodec(QuantFormat(bits, group)))
    keys, values = torch.randn(2, 3, 40, 32) * 3, torch.randn(2, 3, 40, 32)
    store.append(keys, values)
    for name, got, want in zip("kv", store.slots(), (keys, values), strict=True):
        groups = want.unflatten(-1, (32 // group, group))
        if bits == "fp8":  # e4m3: 3 mantissa bits, relative error at most 2^-4, plus the scale's rounding
            bound = groups.abs() * 2**-4 + groups.abs().amax(-1, keepdim=True) / 448 * 2**-9
        else:  # half the stored (float16, rounded up) scale of the token's group
            bound = store.fields[f"{name}_scale"][:, :, :40, :, None].float() / 2
            assert (bound * 2 <= (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / (2**bits - 1)
                    * 1.01 + 1e-3).all()
        assert ((got.unflatten(-1, (32 // group, group)) - groups).abs() <= bound * (1 + 1e-6) + 1e-6).all()


def test_a_sink_cache_with_int4_storage_holds_an_eighth_of_the_float32_payload():
    model = get_model("llama")
    sizes = {}
    for bits, first in ((None, None), (4, 0), (4, None)):  # (int4 with the default: its 2 sinks exact)
        cache = SinkCache(model.config, num_sinks=2, window=30, bits=bits, group_size=None if bits is None else 16,
                          first_tokens=first)  # fmt: skip
        with torch.no_grad():
            model(make_prompt(60), **cache_kwargs(cache))
            for t in range(10):
                model(make_prompt(1, seed=t), **cache_kwargs(cache))
        sizes[bits, first] = cache.memory_report()
    full, coded, exact_sinks = sizes[None, None], sizes[4, 0], sizes[4, None]
    assert coded.tokens_held == full.tokens_held == exact_sinks.tokens_held == 32
    # float32 K/V of 16 channels -> 8 bytes of int4 codes + one float16 scale and zero per token and tensor.
    assert coded.payload_bytes * 64 == full.payload_bytes * 8
    assert coded.total_bytes < 0.3 * full.total_bytes
    # Exact sinks add their float32 keys and values (2 sinks and a spare entry per head and layer), nothing else.
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert exact_sinks.payload_bytes - coded.payload_bytes == layers * heads * (2 + 1) * 2 * 16 * 4
    assert exact_sinks.total_bytes < 0.4 * full.total_bytes


QUANTIZED_SLOTS = {
    "sink": lambda config, bits: SinkCache(config, num_sinks=2, window=8, bits=bits, group_size=16),
    # H2O ranks by the attention mass: the quantized kernel reports it, and the same slots are evicted.
    "h2o": lambda config, bits: H2OCache(config, budget=10, recent=4, bits=bits, group_size=16),
}


@pytest.mark.parametrize("name", QUANTIZED_SLOTS)
@pytest.mark.parametrize("bits", [4, "fp8"])
def test_quantized_slots_decode_reads_the_codes_in_place_as_the_dequantized_slots_would(monkeypatch, bits, name):
    """A decode step of an evicting cache with quantized slots attends over the codes (keys per token) without
    dequantizing the slots; its logits equal those of attention over the dequantized slots."""
    model = get_model("llama")
    input_ids, mask = left_padded_batch()  # 3 rows, left-padded to 12; a budget of 10 evicts from the prompt on

    def logits(in_place):
        cache = QUANTIZED_SLOTS[name](model.config, bits)
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=mask, **cache_kwargs(cache))
            seen, out = mask, []
            for t in range(12):
                seen = torch.cat([seen, seen.new_ones(3, 1)], dim=1)
                step = make_prompt(1, seed=t).expand(3, 1)
                if in_place:  # the decode steps must not build the dense slots
                    with monkeypatch.context() as patched:
                        patched.setattr(SlotStore, "slots", lambda self: pytest.fail("dequantized the slots"))
                        out.append(model(input_ids=step, attention_mask=seen, **cache_kwargs(cache)).logits)
                else:
                    out.append(model(input_ids=step, attention_mask=seen, **cache_kwargs(cache)).logits)
        return torch.cat(out, dim=1)

    in_place = logits(in_place=True)
    decode = route.slot_decode  # the dequantizing route: attention over the dense slots, read as they are now
    monkeypatch.setattr(route, "slot_decode", lambda q, read, *a, **k: decode(q, SlotRead(*read.dense(), read.valid), *a, **k))
    torch.testing.assert_close(in_place, logits(in_place=False), atol=1e-5, rtol=1e-5)


def _held_by_position(layer):
    """Layer keys/values of row 0, head 0, keyed by position (slot order is the cache's business)."""
    keys, values = layer.keys, layer.values
    store = layer.storage
    hole = store.hole if store.hole is None or isinstance(store.hole, int) else int(store.hole[0, 0, 0])
    live = [i for i in range(store.length) if i != hole]
    positions = store.pos[0, 0, live].tolist()
    return {p: (keys[0, 0, j].clone(), values[0, 0, j].clone()) for j, p in enumerate(positions)}


@pytest.mark.parametrize("positions", ["cache", "original"])
def test_sink_ring_evicts_by_bookkeeping_and_matches_ranked_eviction(monkeypatch, positions, seed):
    """StreamingLLM's victim is known in Python ints, so a decode step refills the freed slot and moves
    nothing; the tokens held, their keys and the logits are those of eviction by priority and argmin,
    across wraps of the ring, a multi-token forward in between (which settles the hole), and reads of
    `keys`/`memory()` between steps."""
    from hf_kvplus.eviction.sinks import SinkPolicy

    model = get_model("llama")
    ids = make_prompt(40, batch=2)

    def run(ring: bool):
        if not ring:
            monkeypatch.setattr(SinkPolicy, "victim", lambda self, store: None)
        cache = SinkCache(model.config, num_sinks=2, window=5, positions=positions)
        logits, versions, views = [], [], []
        with torch.no_grad():
            model(ids[:, :9], **cache_kwargs(cache))
            for t in range(9, 40):
                if t == 25:  # a chunk of three: the hole settles, the ring starts again after compaction
                    logits.append(model(ids[:, t : t + 3], **cache_kwargs(cache)).logits[:, -1])
                    continue
                if 25 < t < 28:
                    continue
                logits.append(model(ids[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1])
                if t < 25:
                    versions.append(cache.layers[0].storage.version)
                if t % 7 == 0:
                    views.append(_held_by_position(cache.layers[0]))
                    assert cache.layers[0].memory().tokens_held == 7
        monkeypatch.undo()
        return cache, torch.stack(logits), versions, views

    ring, ring_logits, ring_versions, ring_views = run(True)
    ranked, ranked_logits, ranked_versions, ranked_views = run(False)
    torch.testing.assert_close(ring_logits, ranked_logits, atol=1e-5, rtol=1e-5)
    ring_views.append(_held_by_position(ring.layers[0]))
    ranked_views.append(_held_by_position(ranked.layers[0]))
    for got, want in zip(ring_views, ranked_views, strict=True):
        assert sorted(got) == sorted(want)
        for p in want:
            torch.testing.assert_close(got[p], want[p], atol=1e-6, rtol=1e-6)
    # Ranked eviction frees a slot chosen on the device every step; the ring follows its layout in Python
    # ints and never gives it up. (After the chunk the model passed a mask, so the layer tracks padding
    # on the device and ranks again: correct, only slower.)
    assert len(set(ranked_versions)) == len(ranked_versions)
    assert len(set(ring_versions)) == 1


@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
def test_token_codec_quantizes_keys_and_values_together_as_apart(bits):
    """One call for a token's key and value (a decode step's ops) gives the codes of two separate calls."""
    codec = TokenQuantCodec(QuantFormat(bits, 8))
    keys, values = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16) * 4
    together = codec.encode(keys, values)
    apart = {**codec.encode_keys(keys), **codec._encode("v", values)}
    assert list(together) == list(apart)
    for name, part in apart.items():
        assert torch.equal(together[name], part), name


@pytest.mark.parametrize("name", ["sink", "h2o"])
def test_prefill_compression_compresses_each_prompt_and_lets_decode_steps_append(name):
    model = get_model("llama")
    build = {"sink": lambda c, **k: SinkCache(c, num_sinks=2, window=6, **k), "h2o": lambda c, **k: H2OCache(c, budget=8, **k)}
    caches = {compress: build[name](model.config, compress=compress) for compress in ("always", "prefill")}
    held = {compress: [] for compress in caches}
    with torch.no_grad():
        for compress, cache in caches.items():
            model(make_prompt(20), **cache_kwargs(cache))
            held[compress].append(cache.layers[0].storage.held)
            for t in range(5):
                model(make_prompt(1, seed=t), **cache_kwargs(cache))
                held[compress].append(cache.layers[0].storage.held)
            model(make_prompt(4, seed=9), **cache_kwargs(cache))  # a second prompt compresses again
            held[compress].append(cache.layers[0].storage.held)
    assert held["always"] == [8] * 7
    assert held["prefill"] == [8, 9, 10, 11, 12, 13, 8]
    assert caches["prefill"].get_seq_length() == caches["always"].get_seq_length() == 29


def test_a_sink_cache_compressing_its_prompt_decodes_as_dynamic_with_the_evicted_tokens_masked():
    """SinkCache(positions="original", compress="prefill") keeps the prompt's sinks and last window, then
    appends: each greedy step equals DynamicCache's over the whole prompt with the evicted tokens masked."""
    model = get_model("llama")
    num_sinks, window, prompt, steps = 2, 6, 20, 8
    ids = make_prompt(prompt)
    cache = SinkCache(model.config, num_sinks=num_sinks, window=window, positions="original", compress="prefill")
    dense = DynamicCache(config=model.config)
    mask = torch.ones(1, prompt, dtype=torch.long)
    mask[:, num_sinks : prompt - window] = 0
    positions = torch.arange(prompt)[None]
    got, want = [], []
    with torch.no_grad():
        token = model(ids, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        # The prompt's own forward sees every token (eviction follows it): only later queries see the mask.
        reference = model(ids, **cache_kwargs(dense), position_ids=positions).logits[:, -1:].argmax(-1)
        assert torch.equal(token, reference)
        for step in range(steps):
            got.append(token)
            want.append(reference)
            position = torch.tensor([[prompt + step]])
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
            token = model(token, **cache_kwargs(cache), position_ids=position).logits[:, -1:].argmax(-1)
            reference = model(reference, **cache_kwargs(dense), attention_mask=mask,
                              position_ids=position).logits[:, -1:].argmax(-1)
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))
    assert cache.layers[0].storage.held == num_sinks + window + steps


def test_prefill_compression_is_refused_with_compile_and_unknown_modes():
    config = get_model("llama").config
    with pytest.raises(ConfigError, match="compileable=True needs compress='always'"):
        SinkCache(config, num_sinks=2, window=6, compress="prefill", compileable=True)
    with pytest.raises(ConfigError, match=r"compress must be one of \('always', 'prefill'\), got compress='once'"):
        H2OCache(config, budget=8, compress="once")
