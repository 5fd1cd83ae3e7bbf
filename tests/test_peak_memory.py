"""Peak memory of a prefill + decode: what a layer's attention reads is freed with that layer, by reference counting.

A layer's `update` hands attention a read (`storage.reads`) on the key tensor it returns. Were the read to hold that
very tensor, the two would form a reference cycle: the read, and what it views (a block pool or code buffer since
regrown, the window's copies), would outlive the layer and pile up until Python's cycle collector happened to run.
Measured on an 8B-shaped model at 16K tokens on a GPU, that doubled the peak of the paged and quantized caches.

The peak here is the largest sum of live CPU tensor bytes over the run (the profiler's allocations minus frees, in
order: what the CUDA allocator's peak is on a GPU), with the cycle collector off, so that it counts what reference
counting alone frees.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_kvplus.memory import cache_bytes
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.reads import DenseRead, PackedRead, PagedRead, SlotRead
from hf_kvplus.transformers_compat import cache_kwargs

BATCH, PROMPT, CHUNK, STEPS, KV_HEADS, HEAD_DIM = 2, 1024, 256, 8, 4, 64
#: One layer's K/V in float32 at the run's last length: what SDPA reads in a prefill chunk, gathered or dequantized.
LAYER_KV = 2 * BATCH * KV_HEADS * (PROMPT + STEPS) * HEAD_DIM * 4


@pytest.fixture(scope="module")
def model():
    # Small everywhere but the K/V, so that the cache's bytes, not the activations, decide the peak.
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=128, max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def prefill_and_decode(model, spec: str, prompt: torch.Tensor, steps: int):
    """The cache after a prefill in chunks of `CHUNK` and `steps` greedy decode steps."""
    cache = parse_cache_spec(spec).build(model.config, max_length=prompt.shape[1] + steps)
    with torch.inference_mode():
        for first in range(0, prompt.shape[1], CHUNK):
            logits = model(input_ids=prompt[:, first : first + CHUNK], **cache_kwargs(cache), logits_to_keep=1).logits
        for _ in range(steps):
            logits = model(input_ids=logits.argmax(-1), **cache_kwargs(cache), logits_to_keep=1).logits
    return cache


def live_peak(run) -> tuple[int, object]:
    """The largest sum of live CPU tensor bytes allocated by `run()`, with the cycle collector off, and its result."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (SDPA's CPU buffers are per thread)
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = run()
    finally:
        gc.enable()
        torch.set_num_threads(threads)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result


def prompt_ids() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("spec", ["paged", "quantized:int4", "paged-quantized:int4", "quantized:k4v2"])
def test_peak_is_the_cache_at_rest_and_one_layers_dense_kv(model, spec):
    # Above its bytes at rest a run holds one layer's dense K/V (SDPA's input in a prefill chunk) and, as slack, at most
    # two more layers' worth for the chunk's activations and the coding's temporaries (measured: 1.6 layers paged, 2.7
    # quantized). A read that outlives its layer keeps a layer's worth per chunk and layer (measured: 7 to 11 here).
    peak, cache = live_peak(lambda: prefill_and_decode(model, spec, prompt_ids(), STEPS))
    at_rest = cache_bytes(cache)
    assert peak <= at_rest + 3 * LAYER_KV, (
        f"{spec}: peak {peak / 2**20:.2f} MiB, at rest {at_rest / 2**20:.2f} MiB: "
        f"{(peak - at_rest) / LAYER_KV:.2f} layers' K/V ({LAYER_KV / 2**20:.2f} MiB each) above it"
    )


@pytest.mark.parametrize(
    "spec", ["dense", "paged", "quantized:int4", "paged-quantized:int4", "quantized:k4v2", "sink:4:60", "h2o:64",
             "snapkv:64"]
)  # fmt: skip
def test_no_read_is_left_to_the_cycle_collector(model, spec):
    # Every read of a chunk and of decode steps is freed when its layer is done: none is cyclic garbage.
    prompt = prompt_ids()[:, : 2 * CHUNK]
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable goes to gc.garbage
    try:
        cache = prefill_and_decode(model, spec, prompt, 3)
        gc.collect()
        reads = [type(o).__name__ for o in gc.garbage if type(o) in (DenseRead, PagedRead, PackedRead, SlotRead)]
        tensors = sum(o.untyped_storage().nbytes() for o in gc.garbage if isinstance(o, torch.Tensor))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cache.get_seq_length() == 2 * CHUNK + 3
    assert not reads and not tensors, f"{spec}: cyclic garbage of {len(reads)} reads ({set(reads)}), {tensors} bytes"
