"""Values a quantized format cannot code: NaN, inf, and finite values beyond its float16 scales, zero
points or norms. A prompt holding them is refused with `OutOfRangeError` naming the numbers, before the layer
changes; a decode step's such value is coded as 0 when it leaves the window, never spoils the other tokens of its
group, and `quantized_report()` raises for it. optimum-quanto (float32 scales) codes any finite value."""

import functools
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from hf_kvplus import H2OCache, OutOfRangeError, PagedCache, QuantizedCache, SinkCache, SnapKVCache
from hf_kvplus.evicting_cache import PeakCache
from hf_kvplus.formats import parse_bits, resolve_format
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.model_spec import ModelSpec
from hf_kvplus.storage.slots import SlotStore, TokenQuantCodec
from hf_kvplus.storage.value_range import code_limit

FORMATS = [8, 4, 2, "fp8", "k4v2", "k2v4"]
SPIKES = [1e6, -1e8, float("nan"), float("inf"), -float("inf")]


def config():
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                       vocab_size=64)  # fmt: skip


def kv(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, 16, generator=g), torch.randn(1, 2, tokens, 16, generator=g)


def caches(bits):
    yield QuantizedCache(config(), bits=bits, window=16)
    yield QuantizedCache(config(), bits=bits, window=16, max_tokens=128, compileable=True)
    if not (isinstance(bits, str) and bits.startswith("k")):
        yield PagedCache(config(), bits=bits, window=16, block_size=16)
    yield SinkCache(config(), num_sinks=4, window=60, bits=bits)


@pytest.mark.parametrize("spike", SPIKES)
@pytest.mark.parametrize("bits", FORMATS)
@torch.no_grad()
def test_a_prompt_the_codes_cannot_hold_is_refused_by_its_numbers(bits, spike):
    limit, _ = code_limit(resolve_format(ModelSpec.from_config(config()), parse_bits(bits), None))
    for cache in caches(bits):
        k, v = kv(64)
        k[0, 1, 5, 3] = spike
        if abs(spike) <= limit:  # finite and within the codes' range: coded, and decoded to about itself
            cache.update(k, v, 0)
            got = cache.layers[0].keys
            assert torch.isfinite(got).all() and got[0, 1, 5, 3].item() == pytest.approx(spike, rel=0.07)
            continue
        with pytest.raises(OutOfRangeError, match=r"layer 0: .* codes hold finite .* up to .*got keys' largest"):
            cache.update(k, v, 0)
        assert cache.get_seq_length() == 0, type(cache).__name__  # refused before the layer changed
        k[0, 1, 5, 3] = 0.5
        cache.update(k, v, 0)  # the same cache takes a prompt it can hold


@pytest.mark.parametrize("bits", FORMATS)
@torch.no_grad()
def test_the_message_names_the_magnitude(bits):
    k, v = kv(64)
    v[0, 0, 9, 0] = float("nan")
    k[0, 0, 7] *= 1e6
    with pytest.raises(OutOfRangeError, match=r"largest finite (magnitude|vector norm) [0-9.]+e\+06 \(0 non-finite \w+\), values' .* \(1 non-finite\)"):
        QuantizedCache(config(), bits=bits, window=16).update(k, v, 0)


@pytest.mark.parametrize("spike", SPIKES)
@pytest.mark.parametrize("bits", FORMATS)
@torch.no_grad()
def test_a_decode_steps_bad_value_spoils_no_other_tokens_codes_and_is_reported(bits, spike):
    for make in (lambda: QuantizedCache(config(), bits=bits, window=16),
                 lambda: QuantizedCache(config(), bits=bits, window=16, max_tokens=128, compileable=True),
                 lambda: PagedCache(config(), bits=bits, window=16, block_size=16)):  # fmt: skip
        if isinstance(bits, str) and bits.startswith("k") and make().__class__ is PagedCache:
            continue
        clean, spiked = make(), make()
        k, v = kv(80, seed=1)
        for cache in (clean, spiked):
            cache.update(k[:, :, :32].clone(), v[:, :, :32].clone(), 0)
        for t in range(32, 80):  # decode steps: token 40 leaves the window and is coded
            kt, vt = k[:, :, t : t + 1].clone(), v[:, :, t : t + 1].clone()
            clean.update(kt.clone(), vt.clone(), 0)
            if t == 40:
                kt[0, 1, 0, 3] = spike
            spiked.update(kt, vt, 0)
        got, want = spiked.layers[0].keys, clean.layers[0].keys
        assert torch.isfinite(got).all(), f"{bits}: {(~torch.isfinite(got)).any(-1).sum().item()} tokens decode to inf/NaN"
        limit, _ = code_limit(resolve_format(ModelSpec.from_config(config()), parse_bits(bits), None))
        if abs(spike) <= limit:  # within range: coded (its group's scale grows with it), nothing to report
            spiked.quantized_report()
            continue
        others = torch.ones(got.shape[2], dtype=torch.bool)
        others[40] = False
        assert torch.equal(got[:, :, others], want[:, :, others]), f"{bits}: other tokens' codes changed"
        with pytest.raises(OutOfRangeError, match=r"1 earlier decode-step (values|vectors) out of range, coded as 0"):
            spiked.quantized_report()
        clean.quantized_report()
        spiked.quantized_report()  # reported once


@torch.no_grad()
def test_quanto_codes_any_finite_value_and_refuses_nan():
    k, v = kv(64)
    k[0, 1, 5, 3] = 1e6
    cache = QuantizedCache(config(), bits=4, window=16, backend="quanto")
    cache.update(k, v, 0)
    got = cache.layers[0].keys
    assert got[0, 1, 5, 3].item() == pytest.approx(1e6, rel=1e-3)
    assert torch.isfinite(got).all()
    k[0, 1, 5, 3] = float("nan")
    with pytest.raises(OutOfRangeError, match=r"1 non-finite"):
        QuantizedCache(config(), bits=4, window=16, backend="quanto").update(k, v, 0)


# Evicting caches code each token into its own slot as it comes (`storage.slots`): a prompt is checked whole, a
# decode step's token goes through the store's `RangeGuard` (coded as 0, counted on the device, reported later).
EVICTING = {
    "sink": lambda bits: SinkCache(config(), num_sinks=4, window=28, bits=bits),
    "sink-compileable": lambda bits: SinkCache(config(), num_sinks=4, window=28, bits=bits, compileable=True),
    "sink-first": lambda bits: SinkCache(config(), num_sinks=4, window=28, bits=bits, first_tokens=2),
    "h2o": lambda bits: H2OCache(config(), budget=32, bits=bits),
    "snapkv": lambda bits: SnapKVCache(config(), budget=32, observation=4, bits=bits),
    "peak": lambda bits: PeakCache(config(), budget=32, bits=bits),
}
PROMPT, STEPS, SPIKED = 36, 8, 40  # decode steps at positions 36 .. 43, the one at 40 given the spike


def forward(cache, k, v):
    """What a model's layer does with the cache: update, then attend (an evicting layer scores and evicts there)."""
    keys, values = cache.update(k, v, 0)
    query = torch.randn(k.shape[0], 4, k.shape[2], 16, generator=torch.Generator().manual_seed(k.shape[2]))
    cache.layers[0].attend(SimpleNamespace(layer_idx=0), query, keys, values, None, 0.25)


def decoded(bits, name, spike=None, side="keys"):
    """A prompt then decode steps, one with one `spike` in its keys (or values); the next prompt's keys and values."""
    cache = EVICTING[name](bits)
    k, v = kv(PROMPT + STEPS + 3, seed=1)
    forward(cache, k[:, :, :PROMPT], v[:, :, :PROMPT])
    for t in range(PROMPT, PROMPT + STEPS):
        kt, vt = k[:, :, t : t + 1].clone(), v[:, :, t : t + 1].clone()
        if t == SPIKED and spike is not None:
            (kt if side == "keys" else vt)[0, 1, 0, 3] = spike
        forward(cache, kt, vt)
    return cache, (k[:, :, PROMPT + STEPS :], v[:, :, PROMPT + STEPS :])


def held_by_position(cache) -> dict:
    """{(row, head, position): (key, value)} of the tokens the cache's evicting layer holds, dequantized."""
    store = cache.layers[0].storage
    keys, values = store.slots()
    pos = store.positions.tolist()
    return {(b, h, p): (keys[b, h, j], values[b, h, j])
            for b, row in enumerate(pos) for h, head in enumerate(row) for j, p in enumerate(head) if p >= 0}  # fmt: skip


@functools.cache
def clean_run(bits, name) -> dict:
    """`held_by_position` after in-range decode steps, which the report and the next prompt take without a word."""
    cache, prompt = decoded(bits, name)
    held = held_by_position(cache)
    cache.quantized_report()
    forward(cache, *prompt)
    return held


@pytest.mark.parametrize(("spike", "side"), [(1e6, "keys"), (-1e8, "values"), (float("nan"), "keys"), (float("inf"), "values")])
@pytest.mark.parametrize("bits", FORMATS)
@torch.no_grad()
def test_an_evicting_caches_decode_step_the_codes_cannot_hold_is_reported_and_spoils_no_other_slot(bits, spike, side):
    limit, by_norm = code_limit(resolve_format(ModelSpec.from_config(config()), parse_bits(bits), None))
    reported = rf"layer 0: .* codes hold finite .* up to .*, 1 earlier decode-step {'vectors' if by_norm else 'values'} out of range, coded as 0"
    for i, name in enumerate(EVICTING):
        spiked, prompt = decoded(bits, name, spike, side)
        got = spiked.layers[0].keys, spiked.layers[0].values
        assert all(torch.isfinite(x).all() for x in got), f"{name} {bits}: a slot decodes to inf/NaN"
        want, have = clean_run(bits, name), held_by_position(spiked)
        same = [at for at in want.keys() & have.keys() if at[2] != SPIKED]
        assert len(same) > 50, name  # (32 tokens per head held)
        for at in same:  # per-token codes: every other token decodes as it did without the spike
            assert all(torch.equal(a, b) for a, b in zip(want[at], have[at], strict=True)), f"{name} {bits}: {at}"
        if abs(spike) <= limit:  # within range: coded, nothing to report
            spiked.quantized_report()
            forward(spiked, *prompt)
        elif i % 2:  # at the next prompt, before the layer changes; then once only
            seen = spiked.get_seq_length()
            with pytest.raises(OutOfRangeError, match=reported):
                forward(spiked, *prompt)
            assert spiked.get_seq_length() == seen, name
            forward(spiked, *prompt)
            spiked.quantized_report()
        else:  # at the report; then once only
            with pytest.raises(OutOfRangeError, match=reported):
                spiked.quantized_report()
            forward(spiked, *prompt)
            spiked.quantized_report()


@pytest.mark.parametrize("bits", FORMATS)
@torch.no_grad()
def test_a_slot_stores_first_token_the_codes_cannot_hold_spoils_no_later_codes(bits):
    """A one-token first forward is a decode step (no prompt check): a rotated format's key centre, set from the
    first keys coded, must not be set from what the codes cannot hold."""
    fmt = resolve_format(ModelSpec.from_config(config()), parse_bits(bits), None)
    store = SlotStore(TokenQuantCodec(fmt.for_layer(0), fmt.make_state()))
    k, v = kv(6)
    k[0, 0, 0, 1] = float("nan")
    for t in range(6):
        store.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    keys, values = store.slots()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert store.range_guard.take().item() == 1


@torch.no_grad()
def test_a_compiled_decode_step_of_quantized_slots_counts_on_the_device_in_one_graph():
    """A compileable store's guard counts in place (its counter at a static address, as the fields), in a graph with
    no break; the other slots' codes stay as they were."""
    stores = [SlotStore(TokenQuantCodec(QuantFormat(4, 16)), scores=False, device_count=True) for _ in range(2)]
    k, v = kv(12, seed=2)
    torch._dynamo.reset()
    steps = [torch.compile(store.append, fullgraph=True, backend="eager") for store in stores]
    for store in stores:
        store.append(k[:, :, :8], v[:, :, :8])
        store.fill_free(12)
    for t in range(8, 11):
        for i, (store, step) in enumerate(zip(stores, steps, strict=True)):
            kt = k[:, :, t : t + 1].clone()
            if i and t == 9:
                kt[0, 1, 0, 2] = float("inf")
            step(kt, v[:, :, t : t + 1])
            store.free(torch.full((1, 2, 1), t + 1))  # the next free slot becomes the hole
    clean, spiked = stores
    assert spiked.range_guard.in_place and spiked.range_guard.pending.item() == 1
    assert clean.range_guard.pending.item() == 0
    for name, field in spiked.fields.items():  # every code, scale and zero point but slot 9's (of head 1)
        others = torch.ones(field.shape[:3], dtype=torch.bool)
        others[0, 1, 9] = False
        assert torch.equal(field[others], clean.fields[name][others]), name
    assert torch.isfinite(spiked.slots()[0]).all()


@pytest.mark.parametrize("bits", [4, "k4v2"])
@torch.no_grad()
def test_reset_forgets_what_a_decode_step_gave_out_of_range(bits):
    """The message says to reset() the cache: the count of the values coded as 0 goes with the tokens."""
    quantized = lambda cache, k, v: cache.update(k, v, 0)  # noqa: E731
    caches = [(QuantizedCache(config(), bits=bits, window=16), quantized),
              (QuantizedCache(config(), bits=bits, window=16, max_tokens=128, compileable=True), quantized),
              (EVICTING["sink"](bits), forward), (EVICTING["sink-compileable"](bits), forward)]  # fmt: skip
    k, v = kv(60, seed=2)
    for cache, step in caches:
        step(cache, k[:, :, :32].clone(), v[:, :, :32].clone())
        for t in range(32, 60):
            kt = k[:, :, t : t + 1].clone()
            if t == 36:
                kt[0, 0, 0, 1] = float("inf")
            step(cache, kt, v[:, :, t : t + 1].clone())
        cache.reset()
        step(cache, k[:, :, :32].clone(), v[:, :, :32].clone())  # a new prompt: nothing to report
        cache.quantized_report()


@pytest.mark.parametrize("bits", [8, 4, "fp8"])
@pytest.mark.parametrize("compileable", [False, True])
@torch.no_grad()
def test_a_sink_that_a_rotation_would_take_out_of_range_is_reported_not_coded_as_inf(bits, compileable):
    """A SinkCache rotates its sinks' keys to their positions in the cache and codes them again. A key pair of 60000
    each is within what integer codes hold (65000), but rotated it reaches 84853: the sinks' copy keeps such a pair
    as 0 and the report names it, where the codes would have held inf or NaN."""
    cache = SinkCache(config(), num_sinks=4, window=28, bits=bits, compileable=compileable)
    k, v = kv(48, seed=3)
    k[0, 1, 0, 3] = k[0, 1, 0, 3 + 8] = 60000.0  # token 0 is a sink; channels 3 and 11 are a rotary pair
    forward(cache, k[:, :, :30], v[:, :, :30])
    for t in range(30, 48):  # the window fills, tokens are evicted, the sinks are rotated
        forward(cache, k[:, :, t : t + 1], v[:, :, t : t + 1])
    keys = cache.layers[0].keys
    assert torch.isfinite(keys).all(), f"{(~torch.isfinite(keys)).sum().item()} key channels decode to inf/NaN"
    limit, _ = code_limit(resolve_format(ModelSpec.from_config(config()), parse_bits(bits), None))
    if 60000.0 * 2**0.5 <= limit:  # fp8 codes hold it
        cache.quantized_report()
        return
    with pytest.raises(OutOfRangeError, match=r"2 earlier decode-step values out of range"):
        cache.quantized_report()
    cache.quantized_report()  # once
