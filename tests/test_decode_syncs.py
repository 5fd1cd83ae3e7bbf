"""No cache makes a decode step wait for the device: it adds no host read of tensor values to the step.

Each cache decodes the same teacher-forced tokens as a DynamicCache, through steps that evict (sink, H2O,
SnapKV budgets far below the sequence), flush a quantized group (groups and windows of 8), start a new
paged block (blocks of 8) and fetch offloaded layers (every step), in an unpadded and a left-padded batch.
Per step, the ops that read device values on the host (`hf_kvplus.evaluation.host_cost`) must be the
model's own: no more than the same step with DynamicCache makes (Transformers' mask code makes some
with a padded batch). On CUDA (``--device cuda``) the same steps run under
`torch.cuda.set_sync_debug_mode`, which catches every synchronizing CUDA call, the host copies the op
count cannot see included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from conformance.models import PAD_TOKEN_ID, get_model
from conformance.modes import make_prompt
from hf_kvplus import cache_kwargs
from hf_kvplus.evaluation.host_cost import count_syncs
from hf_kvplus.specs import parse_cache_spec

SPECS = [
    "dense",
    "dense:max_tokens=64",
    "dense:max_tokens=64:compile=on",
    "paged:block=8",
    "paged:block=8:max_tokens=64",
    "paged:block=8:max_tokens=64:compile=on",
    "quantized:int4:group=8:window=8:max_tokens=64:compile=on",
    "quantized:int8:group=8:window=8",
    "quantized:int4:group=8:window=8",
    "quantized:int2:group=8:window=8",
    "quantized:fp8:group=8:window=8",
    "paged-quantized:int4:group=8:window=8:block=8",
    "sink:2:6",
    "sink:2:6:bits=int4:group=8",
    "h2o:8",
    "snapkv:8:observation=4",
    "offloaded",
    "offloaded:disk=tmp",
    "offloaded-quantized:int4:group=8:window=8",
    "quantized:k4v2:window=8:max_tokens=64:compile=on",
    "quantized:k3v2:window=8",
    "paged-quantized:k2v2:window=8:block=8",
    "sink:2:6:bits=k4v2",
    "offloaded-quantized:k4v4:window=8",
    "sink:2:6:bits=int4:group=8:first=2",
    "h2o:8:recent=4:bits=k4v2:first=2:compile=on",
    "paged-quantized:int4:group=8:window=8:block=8:boundary=1",
]
PROMPT, STEPS = 10, 20


def decode_syncs(model, cache, ids, mask, forced, count=count_syncs) -> list:
    """Prefill `ids`, then feed `forced` one token at a time; `count` of each decode step (by default its host
    reads; `cuda_syncs`: its synchronizing CUDA calls)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        counts = []
        for i in range(forced.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = positions[:, -1:] + 1 + i
            step = dict(input_ids=forced[:, i : i + 1], attention_mask=mask, position_ids=position, **cache_kwargs(cache))
            counts.append(count(lambda step=step: model(**step)))
    return counts


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("spec", SPECS)
def test_decode_steps_add_no_host_reads(spec, padded):
    model = get_model("llama")
    ids = make_prompt(PROMPT, batch=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
        ids = ids.masked_fill(mask == 0, PAD_TOKEN_ID)
    forced = make_prompt(STEPS, batch=2, seed=5)
    baseline = decode_syncs(model, DynamicCache(config=model.config), ids, mask, forced)
    cache = parse_cache_spec(spec).build(model.config, max_length=PROMPT + STEPS + 1)
    got = decode_syncs(model, cache, ids, mask, forced)
    extra = [(step, dict(c - b)) for step, (c, b) in enumerate(zip(got, baseline, strict=True)) if c - b]
    assert not extra, f"{spec}: host reads beyond DynamicCache's, by decode step: {extra}"
    assert cache.get_seq_length() == PROMPT + STEPS


def cuda_syncs(step) -> int:
    """The synchronizing CUDA calls of `step()` (`set_sync_debug_mode("warn")`), after what was queued before it."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("spec", SPECS)
def test_decode_steps_make_no_synchronizing_cuda_call(device, spec, padded):
    """The same steps on CUDA: no synchronizing call beyond DynamicCache's (whose steps made one each on an H200,
    torch 2.11 and transformers 5.17: the model's own), after a first run of the same steps with a fresh cache
    (Triton compiles each kernel at its first launch, and may wait then)."""
    if device.type != "cuda":
        pytest.skip("CUDA-only check: run with --device cuda on a machine with a GPU")
    model = get_model("llama")
    ids = make_prompt(PROMPT, batch=2).to(device)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
        ids = ids.masked_fill(mask == 0, PAD_TOKEN_ID)
    forced = make_prompt(STEPS, batch=2, seed=5).to(device)
    runs = {}
    for name, make in (("dynamic", lambda: DynamicCache(config=model.config)),
                       (spec, lambda: parse_cache_spec(spec).build(model.config, max_length=PROMPT + STEPS + 1))):  # fmt: skip
        decode_syncs(model, make(), ids, mask, forced, cuda_syncs)  # compiles every kernel these steps launch
        runs[name] = decode_syncs(model, make(), ids, mask, forced, cuda_syncs)
    extra = [(step, c, b) for step, (c, b) in enumerate(zip(runs[spec], runs["dynamic"], strict=True)) if c > b]
    assert not extra, f"{spec}: synchronizing CUDA calls beyond DynamicCache's (step, cache's, DynamicCache's): {extra}"


def test_the_cuda_count_sees_a_synchronizing_call(device):
    """The CUDA detector can fail: a step that reads a value back is counted."""
    if device.type != "cuda":
        pytest.skip("CUDA-only check: run with --device cuda on a machine with a GPU")
    model = get_model("llama")
    ids = make_prompt(PROMPT, batch=2).to(device)

    class Reading(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            bool(key_states.isnan().any())  # one read per layer
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    counts = decode_syncs(model, Reading(config=model.config), ids, torch.ones_like(ids), ids[:, :2], cuda_syncs)
    assert all(c >= model.config.num_hidden_layers for c in counts), counts


@pytest.mark.parametrize("default_device", [False, True], ids=["plain", "under-a-default-device"])
def test_the_count_sees_host_reads(default_device, request):
    """The detector can fail: a step that reads a value back is counted, once (also where a default device's
    torch function mode calls `tolist` a second time)."""
    if default_device:
        request.getfixturevalue("on_cpu")
    t = torch.arange(4)
    counts = count_syncs(lambda: (bool(t.any()), t.tolist(), t.nonzero(), int(t.max())))
    assert counts["_local_scalar_dense"] == 2 and counts["tolist"] == 1 and counts["nonzero"] == 1


def test_the_count_sees_tensors_made_from_host_data_but_not_queued_index_tensors():
    """`torch.tensor(x, device=...)` copies from pageable host memory on a GPU, which waits: counted on any device,
    once a call; `index_tensor`, which queues its copy without a wait, is not."""
    from hf_kvplus.host_index import index_tensor

    counts = count_syncs(lambda: (torch.tensor(3, device="cpu"), torch.tensor([1.0, 2.0]), index_tensor([1, 2], "cpu")))
    assert counts == {"tensor from host data": 2}, counts


@pytest.mark.parametrize(
    ("spec", "kernels_per_layer_step"),
    [("dynamic", 1), ("quantized:int4:group=8:window=8", 1), ("sink:2:6:bits=int4:group=8:first=0", 3),
     ("sink:2:6:bits=int4:group=8", 2)],
)  # fmt: skip
def test_kernel_time_counts_every_kernel_call_of_a_step_and_unwraps_after(device, spec, kernels_per_layer_step):
    """What the host benchmark (eval/bench_host.py, a CPU benchmark) takes out of a step: each attention call (SDPA
    for Transformers' caches) and each quantize call (a quantized slot store codes the fresh token's key and value
    into its slots in one call, and with coded sinks, `first=0`, re-encodes its re-rotated sinks' keys in another;
    exact sinks, the default, are copied, not coded), timed; the entry points are the original functions again
    afterwards. The counts are the CPU path's (the C++ operators'): CUDA's kernels split the work differently."""
    if device.type != "cpu":
        pytest.skip("the host benchmark times the CPU path's kernel calls; run without --device cuda")
    from hf_kvplus.attention import dispatch, route
    from hf_kvplus.evaluation.host_cost import _kernel_sites, timing_kernels

    model = get_model("llama")
    ids = make_prompt(PROMPT, batch=2)
    cache = parse_cache_spec(spec).build(model.config, max_length=PROMPT + 2)
    before = [getattr(module, name) for module, name in _kernel_sites()]
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
        with timing_kernels() as spent:
            assert route.quantized_decode_attention is not before[2] and dispatch._fallback is not before[6]
            model(input_ids=ids[:, :1], **cache_kwargs(cache))
    assert spent.calls == kernels_per_layer_step * model.config.num_hidden_layers
    assert spent.seconds > 0
    assert [getattr(module, name) for module, name in _kernel_sites()] == before


def _shapes(x):
    """The shape tree of a kernel's output: a tensor's shape and dtype, a tuple's parts, None."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    return None if x is None else tuple(_shapes(part) for part in x)


@pytest.mark.parametrize(
    "spec",
    [
        "dynamic", "paged:block=8", "quantized:int4:group=4:window=4", "sink:2:6:bits=int4:group=8", "h2o:8",
        "h2o:8:bits=int4:group=8",
    ],
)
def test_stubbed_kernels_compute_nothing_and_return_the_kernels_shapes(spec, monkeypatch):
    """What the host benchmark's "stubbed" column runs: inside `stubbing_kernels` no attention kernel (nor a
    quantize into given buffers) computes, and each stub's output has the shapes and dtypes the real kernel's has
    for the same arguments (checked on every kernel call of a real step)."""
    from hf_kvplus.evaluation.host_cost import _kernel_sites, _stub_outputs, stubbing_kernels

    rules, computed, checked = _stub_outputs(), [], []
    for module, name in _kernel_sites():
        kernel = getattr(module, name)

        def recording(*args, kernel=kernel, name=name, **kwargs):
            computed.append(name)
            out = kernel(*args, **kwargs)
            if name in rules:
                expected = rules[name](*args, **kwargs)
                assert _shapes(out) == _shapes_of_rule(expected), f"{spec}: {name}"
                checked.append(name)
            return out

        monkeypatch.setattr(module, name, recording)
    model = get_model("llama")
    ids = make_prompt(PROMPT, batch=2)
    cache = parse_cache_spec(spec).build(model.config, max_length=PROMPT + 3)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
        checked.clear()
        model(input_ids=ids[:, :1], **cache_kwargs(cache))  # a real decode step: every rule checked
        attention = [name for name in checked if not name.startswith("quantize_")]  # (quantizing: checked too)
        assert len(attention) == model.config.num_hidden_layers
        computed.clear()
        with stubbing_kernels() as spent:
            logits = model(input_ids=ids[:, 1:2], **cache_kwargs(cache)).logits
    assert computed == [] and spent.calls >= model.config.num_hidden_layers
    assert logits.shape == (2, 1, model.config.vocab_size) and cache.get_seq_length() == PROMPT + 2


def _shapes_of_rule(spec):
    from hf_kvplus.evaluation.host_cost import _Zeros

    if isinstance(spec, _Zeros | torch.Tensor):
        return (tuple(spec.shape), spec.dtype)
    return None if spec is None else tuple(_shapes_of_rule(part) for part in spec)
