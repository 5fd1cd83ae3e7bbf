"""Values a quantized format cannot code (issue 49): NaN, inf, and finite values beyond its float16 scales, zero
points or norms. A prompt holding them is refused with `OutOfRangeError` naming the numbers, before the layer
changes; a decode step's such value is coded as 0 when it leaves the window, never spoils the other tokens of its
group, and `quantized_report()` raises for it. optimum-quanto (float32 scales) codes any finite value."""

import pytest
import torch
from transformers import LlamaConfig

from hf_kvplus import OutOfRangeError, PagedCache, QuantizedCache, SinkCache
from hf_kvplus.formats import parse_bits, resolve_format
from hf_kvplus.model_spec import ModelSpec
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
