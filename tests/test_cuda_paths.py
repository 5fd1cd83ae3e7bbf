"""What only a CUDA device can show: kernel launches that never wait for the device, and the offloaded
placement's CUDA path (pinned host memory, side streams) giving DynamicCache's tokens.

These run with ``--device cuda`` (the default where a CUDA device is present) and are skipped on the CPU,
where there are no host syncs to count and no bus to cross.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvplus import OffloadedCache, cache_kwargs
from hf_kvplus.kernels.decode_attention import decode_attention_triton, decode_attention_with_mass_triton
from hf_kvplus.kernels.paged_attention import paged_decode_attention_triton, paged_store_triton
from hf_kvplus.kernels.quant_attention import quantized_decode_attention_triton
from hf_kvplus.kernels.quant_format import PackedKV, QuantFormat
from hf_kvplus.kernels.quant_pack import quantize_keys_triton, quantize_values_triton


@pytest.fixture
def cuda(device):
    if device.type != "cuda":
        pytest.skip("CUDA-only path: run with --device cuda on a machine with a GPU")
    return device


B, HQ, HKV, N, D, BLOCK = 2, 8, 2, 96, 64, 16


def _launches(dtype):
    """name -> a no-argument call of each Triton entry point on fresh CUDA inputs."""
    dev = "cuda"
    q = torch.randn(B, HQ, D, device=dev, dtype=dtype)
    k = torch.randn(B, HKV, N, D, device=dev, dtype=dtype)
    v = torch.randn(B, HKV, N, D, device=dev, dtype=dtype)
    mask = torch.ones(B, N, dtype=torch.bool, device=dev)
    mask[1, :7] = False
    scale = 1 / math.sqrt(D)
    pool_k = torch.randn(B * N // BLOCK, HKV, BLOCK, D, device=dev, dtype=dtype)
    pool_v = torch.randn_like(pool_k)
    table = torch.randperm(B * N // BLOCK, device=dev, dtype=torch.int32).view(B, -1)
    slots = torch.arange(B * 3, device=dev).view(B, 3)
    fmt = QuantFormat(4, 32)
    kc, ks, kz = quantize_keys_triton(k, fmt)
    vc, vs, vz = quantize_values_triton(v, fmt)
    packed = PackedKV(kc, ks, kz, vc, vs, vz)
    return {
        "dense": lambda: decode_attention_triton(q, k, v, scale=scale, mask=mask),
        "dense+mass": lambda: decode_attention_with_mass_triton(q, k, v, scale=scale, mask=mask),
        "paged": lambda: paged_decode_attention_triton(
            q, pool_k, pool_v, table, start=3, length=N - 3, scale=scale, mask=mask[:, 3:]
        ),
        "paged store": lambda: paged_store_triton(pool_k, pool_v, k[:, :, :3], v[:, :, :3], slots),
        "int4": lambda: quantized_decode_attention_triton(
            q, packed, fmt, start=0, length=64, scale=scale, residual_k=k[:, :, 64:], residual_v=v[:, :, 64:], mask=mask
        ),
        "quantize keys": lambda: quantize_keys_triton(k, fmt),
        "quantize values": lambda: quantize_values_triton(v, fmt),
    }


LAUNCHES = ("dense", "dense+mass", "paged", "paged store", "int4", "quantize keys", "quantize values")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", LAUNCHES)
def test_kernel_launch_never_waits_for_the_device(cuda, name, dtype):
    """A decode step's kernels are queued, not waited on: no .item(), no host copy, no nonzero."""
    launch = _launches(dtype)[name]
    launch()  # compiles; compilation may touch the device freely
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _rests_per_layer(cache):
    """The tensors at rest of each layer (white box: pinning is the CUDA path's own property)."""
    placement = cache.placement
    return [list(placement._rest(layer.storage).rest.values()) for layer in cache.layers]


def test_offloaded_cache_on_cuda_rests_in_pinned_memory_and_matches_dynamic(cuda):
    from conformance.models import get_model
    from conformance.modes import make_prompt

    model = get_model("llama")
    ids = make_prompt(12, batch=2).to(cuda)
    kwargs = dict(max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        expected = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), **kwargs)
        cache = OffloadedCache(model.config)
        got = model.generate(ids, **cache_kwargs(cache), **kwargs)
    assert torch.equal(got, expected)
    rests = _rests_per_layer(cache)
    assert all(layer and all(t.device.type == "cpu" and t.is_pinned() for t in layer) for layer in rests)
    tiers = cache.tier_bytes()
    assert tiers.host > 0 and tiers.disk == 0
    # Device copies exist only for the layer in use and the one fetched ahead (lookahead 1).
    layer_bytes = max(sum(t.numel() * t.element_size() for t in layer) for layer in rests)
    assert tiers.device <= 2 * layer_bytes
