"""What an evicting cache's decode step codes into its slots reaches an offloaded layer's copy at rest.

The KIVI and rotated encode-into operators (`dispatch.quantize_kv_into`) write the slots' codes through raw pointers.
Slots report no written region (`SlotStore.take_written`: evictions overwrite anywhere), so the offloaded placement
writes a field back when its version counter moved: the operators move it, as an in-place op does. Without that, a
disk-tier layer read back its codes as they were before the step (every decode token's codes lost)."""

from __future__ import annotations

import pytest
import torch

from hf_kvplus import H2OCache, SinkCache, cache_kwargs
from hf_kvplus.kernels import dispatch, rotated_cpu
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.kernels.rotated_format import KeyCenter, RotatedFormat, quantize_rotated
from hf_kvplus.placement.offloaded import Offloaded
from hf_kvplus.storage import slot_codecs

pytestmark = [
    pytest.mark.usefixtures("on_cpu"),
    pytest.mark.skipif(not rotated_cpu.available(), reason="no C++ toolchain: the CPU operators are not built"),
]


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def greedy(model, cache, steps: int = 12) -> list[int]:
    """Tokens of a 16-token prompt and `steps` greedy decode steps (the caches below evict from the first)."""
    tokens = []
    with torch.no_grad():
        logits = model(torch.arange(1, 17)[None], **cache_kwargs(cache), use_cache=True).logits
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = model(token, **cache_kwargs(cache), use_cache=True).logits
    return tokens


CACHES = {
    "sink int4": (SinkCache, dict(num_sinks=2, window=10, bits="int4", group_size=16)),
    "h2o int4": (H2OCache, dict(budget=12, bits="int4", group_size=16)),
    "sink k4v2": (SinkCache, dict(num_sinks=2, window=10, bits="k4v2")),
    "h2o fp8": (H2OCache, dict(budget=12, bits="fp8", group_size=16)),
}


@pytest.mark.parametrize("name", list(CACHES))
def test_decode_steps_coded_into_slots_reach_the_disk_tier(model, name, tmp_path, monkeypatch):
    cls, options = CACHES[name]
    calls = []
    real = slot_codecs.quantize_kv_into
    monkeypatch.setattr(slot_codecs, "quantize_kv_into", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    on_device = cls(model.config, **options)
    offloaded = cls(model.config, placement=Offloaded(host_budget=0, folder=tmp_path), **options)
    want = greedy(model, on_device)
    calls.clear()
    got = greedy(model, offloaded)
    assert calls, "the decode steps did not code their tokens through the encode-into operators"
    assert offloaded.tier_bytes().disk > 0, "nothing went to the disk tier"
    for index, (mine, theirs) in enumerate(zip(offloaded.layers, on_device.layers, strict=True)):
        held, reference = mine.storage.tensors(), theirs.storage.tensors()  # (the offloaded one's: off disk)
        assert held.keys() == reference.keys()
        for field, t in reference.items():
            assert torch.equal(held[field], t), f"{name}: layer {index}'s {field} at rest differs from the device's"
    assert got == want


def _buffers(widths, B=1, H=2, N=5):
    return tuple(torch.zeros(B, H, N, w, dtype=dtype) for w, dtype in widths)


@pytest.mark.parametrize("bits", [4, 2, 8, "fp8"])
def test_kivi_encode_into_moves_the_fields_version_counters(bits):
    fmt = QuantFormat(bits, 16)
    k, v = torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32)
    width = 32 if fmt.is_float else 32 * fmt.bits // 8
    sides = [_buffers([(width, torch.uint8), (2, torch.float16), (2, torch.float16)]) for _ in range(2)]
    if fmt.is_float:
        sides = [(codes, scale, None) for codes, scale, _ in sides]
    before = [t._version for side in sides for t in side if t is not None]
    dispatch.quantize_kv_into(k, v, (fmt, fmt), *sides, 3)
    after = [t._version for side in sides for t in side if t is not None]
    assert all(b > a for a, b in zip(before, after, strict=True)), f"{fmt}: {before} -> {after}"
    one = _buffers([(width, torch.uint8), (2, torch.float16), (2, torch.float16)])
    one = one if not fmt.is_float else (*one[:2], None)
    before = [t._version for t in one if t is not None]
    dispatch.quantize_values_into(v, fmt, one, 1)
    assert all(t._version > b for t, b in zip((t for t in one if t is not None), before, strict=True))


def test_rotated_encode_into_moves_the_fields_version_counters():
    k_fmt, v_fmt = RotatedFormat(4, 4, seed=5), RotatedFormat(2, 2, seed=5)
    center = KeyCenter()
    quantize_rotated(torch.randn(1, 2, 8, 32), k_fmt, "keys", None, center)  # set, as a prompt sets it
    k, v = torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32)
    out_k = (*_buffers([(16, torch.uint8), (1, torch.float16)]), None)
    out_v = (*_buffers([(8, torch.uint8), (1, torch.float16)]), None)
    fields = [t for t in (*out_k, *out_v) if t is not None]
    before = [t._version for t in fields]
    dispatch.quantize_kv_into(k, v, (k_fmt, v_fmt), out_k, out_v, 2, state=center)
    assert all(t._version > b for t, b in zip(fields, before, strict=True)), [t._version for t in fields]
    assert all(t[:, :, 2].abs().sum() > 0 for t in fields)  # (written where asked)
