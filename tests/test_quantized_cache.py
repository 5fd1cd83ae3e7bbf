"""QuantizedCache end to end: construction errors, bytes at rest read off the cache, the fused decode path
against the dense one, and hybrid models."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import ConfigError, KVCache, QuantizedCache, cache_kwargs, quantized_storage
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.retention import SlidingWindow
from hf_kvplus.specs import parse_cache_spec

TARGETS = {8: 0.56, 4: 0.32, 2: 0.19}  # bytes at rest over fp16, window excluded (the targets)


def config(head_dim=64, layers=2, kv_heads=2):
    return LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=layers,
        head_dim=head_dim, vocab_size=64, intermediate_size=64,
    )


def fill(cache, cfg, tokens, dtype=torch.float16, batch=1):
    for layer in range(cfg.num_hidden_layers):
        shape = (batch, cfg.num_key_value_heads, tokens, cfg.head_dim)
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=3), "bits must be 8, 4, 2 or 'fp8'"),
        (dict(bits=16), "got 16"),
        (dict(bits="int3"), "got 'int3'"),
        (dict(bits=True), "got True"),
        (dict(bits=4, group_size=48), "group_size 48 does not divide head_dim 64"),
        (dict(bits=4, group_size=0), "positive int"),
        (dict(bits=4, group_size=32, window=16), r"window \(16 tokens\).*one group \(32 tokens\)"),
        (dict(bits=4, backend="hqq"), "backend must be one of"),
    ],
)
def test_bad_settings_are_refused_at_construction_with_the_numbers(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        QuantizedCache(config(), **kwargs)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_bytes_at_rest_per_token_meet_the_targets(bits):
    cfg = config()
    cache = QuantizedCache(cfg, bits=bits)
    fill(cache, cfg, 1024 + 128)
    report = cache.quantized_report()
    g = cache.format.group_size
    # First principles: b/8 bytes per value, plus a float16 scale and zero point per group of keys (g tokens x 1
    # channel) and of values (1 token x g channels): over float16's 2 bytes per value, b/16 + 2/g.
    assert report["ratio_to_fp16"] == pytest.approx(bits / 16 + 2 / g)
    assert report["ratio_to_fp16"] <= TARGETS[bits]
    assert report["quantized_tokens"] == 1024
    fp16_window = 2 * 2 * cfg.num_key_value_heads * cfg.head_dim * cache.layers[0].storage.recent.length
    assert cache.memory_report().payload_bytes + cache.memory_report().metadata_bytes == pytest.approx(
        report["quantized_bytes"] + cfg.num_hidden_layers * fp16_window
    )


def test_fp8_and_the_default_group_follow_the_head_dim():
    cache = QuantizedCache(config(head_dim=16), bits=8)
    assert cache.format == QuantFormat(8, 16), "default group 64 must fall back to a divisor of head_dim 16"
    cfg = config()
    cache = QuantizedCache(cfg, bits="fp8")
    fill(cache, cfg, 128 + 256)
    assert cache.quantized_report()["ratio_to_fp16"] == pytest.approx(1 / 2 + 1 / 32)


@pytest.mark.parametrize("bits", [8, 4, 2, "fp8", "k4v2", "k3v3", "k8v8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_decode_matches_the_dense_path(arch, bits):
    """sdpa (fused kernel over the packed codes; rotated: in the rotated space) and eager (dense dequantized views)
    see the same stored values."""
    model = get_model(arch)
    prompt = make_prompt(40, seed=3)
    logits = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        try:
            groups = {} if str(bits).startswith("k") else {"group_size": 4}  # rotated formats have none
            cache = QuantizedCache(model.config, bits=bits, window=4, **groups)
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, **cache_kwargs(cache),
                                 output_logits=True, return_dict_in_generate=True)
        finally:
            model.set_attn_implementation("sdpa")
        assert cache.layers[0].in_place == (impl == "sdpa")
        logits[impl] = torch.stack(out.logits)
    torch.testing.assert_close(logits["sdpa"], logits["eager"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_sliding_and_hybrid_models_quantize_and_stay_close(arch):
    model = get_model(arch)
    prompt = make_prompt(30, seed=4)
    ref = model(prompt, **cache_kwargs(DynamicCache(config=model.config))).logits
    cache = QuantizedCache(model.config, bits=8, group_size=4, window=4)
    got = model(prompt, **cache_kwargs(cache)).logits
    assert any(layer.storage.segment.length for layer in cache.layers if hasattr(layer, "storage"))
    # One prefill chunk attends at full precision: identical to the reference.
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # A decode step reads the quantized past: close to the reference, not equal.
    step = torch.tensor([[5]])
    dyn = DynamicCache(config=model.config)
    model(prompt, **cache_kwargs(dyn))
    got_step, ref_step = model(step, **cache_kwargs(cache)).logits, model(step, **cache_kwargs(dyn)).logits
    torch.testing.assert_close(got_step, ref_step, atol=0.15, rtol=0)
    assert not torch.equal(got_step, ref_step)


def test_quantized_storage_composes_with_another_retention():
    cfg = config()
    cache = KVCache(cfg, storage=quantized_storage(cfg, bits=4), retention=lambda spec: SlidingWindow(300))
    fill(cache, cfg, 1000)
    layer = cache.layers[0]
    assert layer.storage.length == 299 and layer.get_seq_length() == 1000
    assert layer.storage.segment.length == 299 - layer.storage.recent.length


def test_cache_specs_name_every_format():
    cfg = config()
    for text, fmt in [("quantized:int8", QuantFormat(8, 64)), ("quantized:int4:group=16", QuantFormat(4, 16)),
                      ("quantized:fp8:window=64", QuantFormat("fp8", 32)), ("quantized:2", QuantFormat(2, 32))]:
        cache = parse_cache_spec(text).build(cfg)
        assert isinstance(cache, QuantizedCache) and cache.format == fmt
    assert parse_cache_spec("quantized:int4:backend=quanto").build(cfg).backend == "quanto"
    paged = parse_cache_spec("paged-quantized:int2:block=64").build(cfg)
    assert paged.format == QuantFormat(2, 32) and paged.block_size == 64
    for bad in ["quantized", "quantized:int3", "quantized:int4:backend=x", "quantized:int4:group=a",
                "paged-quantized", "paged-quantized:int4:backend=quanto"]:
        with pytest.raises(ConfigError):
            parse_cache_spec(bad)
