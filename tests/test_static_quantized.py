"""QuantizedCache(max_tokens=N): static codes for N positions and a full-precision ring window (StaticQuantizedStorage).

It quantizes the same tokens in the same groups as the growing QuantizedCache, so the two agree up to the order
of floating-point sums; what differs is the layout (token t's codes at position t, the exact tokens in a ring)
and that every step reads all positions, masked by the storage itself.
"""

from __future__ import annotations

import pytest
import torch

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import CapacityError, ConfigError, Offloaded, QuantizedCache, cache_kwargs
from hf_kvplus.errors import UnsupportedModelError
from hf_kvplus.formats import QuantFormat
from hf_kvplus.kernels.rotated_format import KeyCenter, RotatedFormat, quantize_rotated, rotation
from hf_kvplus.storage.static_quantized import StaticQuantizedStorage


def generate(cache, new=30, **kwargs):
    model = get_model("llama")
    ids = make_prompt(13, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=new, do_sample=False, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True, disable_compile=True, **kwargs,
        )  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
def test_it_decodes_as_the_growing_quantized_cache_does(bits):
    config = get_model("llama").config
    growing = QuantizedCache(config, bits=bits, group_size=4, window=4)
    static = QuantizedCache(config, bits=bits, group_size=4, window=4, max_tokens=48, compileable=True)
    want, got = generate(growing), generate(static)
    assert torch.equal(got.sequences, want.sequences)
    # Measured (2026-11-24): at most 1.3e-3 (int8) on logits of order 1; the same codes, summed in another order.
    for step, (a, b) in enumerate(zip(got.scores, want.scores, strict=True)):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=0, msg=f"step {step}")
    assert static.quantized_report() == growing.quantized_report()


def test_every_step_reads_all_positions_and_masks_them_itself():
    config = get_model("llama").config
    cache = QuantizedCache(config, bits=4, group_size=4, window=4, max_tokens=30)
    generate(cache, new=10)
    layer = cache.layers[0]
    storage = layer.storage
    assert isinstance(storage, StaticQuantizedStorage)
    assert storage.positions == 28 and storage.ring == 12  # max_tokens - window in whole groups; window + 2 groups
    assert layer.get_mask_sizes(1) == (40, 0)
    keys, _ = layer.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16))
    assert keys.shape[2] == 40
    # 23 tokens held (13 + 9 generated + 1): codes before (23 - 4) // 4 * 4 = 16, the ring's 16..22 exact
    mask = storage._mask(None)
    assert storage.length == 23
    assert mask[:, :28].sum(dim=1).tolist() == [16, 16] and mask[:, :16].all()
    assert mask[:, 28:].sum(dim=1).tolist() == [7, 7]


def test_rolling_back_keeps_the_codes_and_the_exact_tokens():
    fmt = QuantFormat(4, 4)
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    rolled = StaticQuantizedStorage(fmt, window=4, max_tokens=40)
    rolled.append(keys[:, :, :16], values[:, :, :16])
    for t in range(16, 24):
        rolled.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    # 24 held: codes before 20, the ring holds 16..23 exact. 19 kept: the frontier goes back to 12.
    rolled.drop_back(5)
    fresh = StaticQuantizedStorage(fmt, window=4, max_tokens=40)
    fresh.append(keys[:, :, :19], values[:, :, :19])
    (k_rolled, v_rolled), (k_fresh, v_fresh) = rolled.view(19), fresh.view(19)
    # Codes before the new frontier and the exact tokens the ring still held (16..18): identical. 12..15 had
    # left the ring as codes: they come back dequantized, where a fresh storage holds them exact.
    for got, want, exact in ((k_rolled, k_fresh, keys), (v_rolled, v_fresh, values)):
        assert torch.equal(got[:, :, :12], want[:, :, :12]) and torch.equal(got[:, :, 16:], exact[:, :, 16:19])
        assert torch.equal(want[:, :, 12:], exact[:, :, 12:19]) and not torch.equal(got[:, :, 12:16], want[:, :, 12:16])
        torch.testing.assert_close(got[:, :, 12:16], want[:, :, 12:16], atol=0.5, rtol=0)
    rolled.append(keys[:, :, 19:20], values[:, :, 19:20])  # and it goes on from there
    assert rolled.length == 20 and torch.equal(rolled.view(1)[0], keys[:, :, 19:20])


@pytest.mark.parametrize(
    "make, positions",
    # 23 - 5 = 18 tokens can leave the window: in groups of 4, 20 positions; one token per "group", 18
    [(lambda: (QuantFormat(4, 4), None), 20), (lambda: (RotatedFormat(4, 2, 1), KeyCenter()), 18)],
    ids=["int4-g4", "k4v2"],
)
def test_a_storage_filled_to_max_tokens_codes_only_what_leaves_the_window(make, positions):
    """The newest `window` tokens never leave it, so no code position is kept for them; filled token by token to
    exactly `max_tokens`, the storage holds what one with room to spare holds."""
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 23, 16), torch.randn(1, 2, 23, 16)
    (fmt, state), (roomy_fmt, roomy_state) = make(), make()  # (each storage its layer's state)
    tight = StaticQuantizedStorage(fmt, window=5, max_tokens=23, state=state)
    roomy = StaticQuantizedStorage(roomy_fmt, window=5, max_tokens=64, state=roomy_state)
    assert tight.positions == positions
    for storage in (tight, roomy):
        storage.append(keys[:, :, :10], values[:, :, :10])
        for t in range(10, 23):
            storage.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    for got, want in zip(tight.view(23), roomy.view(23), strict=True):
        assert torch.equal(got, want)
    n = tight.frontier(23)
    for name in ("k", "v"):
        assert torch.equal(getattr(tight.buffers, name)[:, :, :n], getattr(roomy.buffers, name)[:, :, :n])
    assert tight.memory().total_bytes < roomy.memory().total_bytes
    with pytest.raises(CapacityError, match="24 tokens per row do not fit in the cache's max_tokens=23"):
        tight.append(keys[:, :, :1], values[:, :, :1])


def test_a_rotated_format_keeps_its_ring_rotated_and_attends_it_as_it_is():
    fmt, center = RotatedFormat(4, 2, 3), KeyCenter()
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 20, 16) + 0.5, torch.randn(1, 2, 20, 16)
    storage = StaticQuantizedStorage(fmt, window=4, max_tokens=40, state=center)
    storage.append(keys[:, :, :12], values[:, :, :12])
    for t in range(12, 20):
        storage.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    # The centre is the mean of the first keys held, as they were.
    torch.testing.assert_close(center.mu, keys[:, :, :12].mean(dim=(0, 2)))
    # 20 held, window 4: codes before 16; the ring (4 + 2 slots) holds tokens 14..19, rotated.
    r = rotation(16, 3)
    slots = torch.arange(14, 20) % storage.ring
    torch.testing.assert_close(storage.ring_k[:, :, slots], keys[:, :, 14:20] @ r, atol=1e-6, rtol=0)
    torch.testing.assert_close(storage.ring_v[:, :, slots], values[:, :, 14:20] @ r, atol=1e-6, rtol=0)
    # Read back in the model's space: the exact tokens as they came (one rotation there and back).
    k, v = storage.view(20)
    torch.testing.assert_close(k[:, :, 16:], keys[:, :, 16:], atol=1e-5, rtol=0)
    torch.testing.assert_close(v[:, :, 16:], values[:, :, 16:], atol=1e-5, rtol=0)
    # The codes are those of the tokens as they were (the rotation applied first instead of after the centre:
    # a code may differ where a coordinate sits on a boundary).
    codes, _ = quantize_rotated(keys[:, :, :16], fmt, "keys", None, center)
    assert (storage.buffers.k[:, :, :16] == codes).float().mean() > 0.99
    # Attention reads the ring as it is: the read's format says its tokens come rotated.
    read = storage.read(20, 1)
    assert read.fmt.inputs_rotated and not storage.fmt.inputs_rotated and read.recent_k is storage.ring_k
    assert read.state is center  # the layer's state goes with the read


def test_capacity_and_bad_construction_are_refused():
    model = get_model("llama")
    cache = QuantizedCache(model.config, bits=4, group_size=4, window=4, max_tokens=20)
    with pytest.raises(CapacityError, match="21 tokens per row do not fit in the cache's max_tokens=20"):
        generate(cache, new=10)
    with pytest.raises(ConfigError, match="needs max_tokens"):
        QuantizedCache(model.config, compileable=True)
    with pytest.raises(ConfigError, match="backend='kvplus'"):
        QuantizedCache(model.config, backend="quanto", max_tokens=64)
    with pytest.raises(ConfigError, match="moves them"):
        QuantizedCache(model.config, max_tokens=64, placement=Offloaded())
    with pytest.raises(ConfigError, match="max_tokens must be an int >= 1, got 0"):
        QuantizedCache(model.config, max_tokens=0)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        QuantizedCache(get_model("gemma3").config, max_tokens=64, compileable=True)
