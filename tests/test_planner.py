"""The memory planner: textbook KV figures, shipped configs, formats, windows, budgets, fits, errors, CLI.

Expectations are derived here from the configs and the byte layouts written out in each test (the
textbook ``2 x layers x kv_heads x head_dim x bytes``, the KIVI group layout), not copied from the
planner's output.
"""

import argparse
import dataclasses
import json
import math
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedConfig

from conformance.models import build_model, make_config
from hf_kvplus import (
    CapacityError,
    ConfigError,
    DenseCache,
    KVPlusError,
    UnsupportedModelError,
    cache_kwargs,
    planner,
)
from hf_kvplus.cli import plan as plan_cli
from hf_kvplus.memory import tensor_bytes

FULL_ATTENTION_MODELS = ["llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "smollm2-135m"]
GEMMA3 = ["gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "gemma-3-270m"]

#: Published parameter counts. Llama 3.1 (Meta model card), Mistral 7B v0.3 and Qwen2.5 7B (model cards);
#: Gemma 3: the text decoder, embedding + non-embedding parameters of the Gemma 3 report's table 1
#: (4B: 675M + 3,209M; 12B: 1,012M + 10,759M; 27B: 1,416M + 25,600M; 270M: 170M + 100M); SmolLM2: 135M.
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "mistral-7b": 7.25e9,
    "qwen2.5-7b": 7.62e9,
    "gemma-3-4b": 3.884e9,
    "gemma-3-12b": 11.771e9,
    "gemma-3-27b": 27.016e9,
    "gemma-3-270m": 0.270e9,
    "smollm2-135m": 0.135e9,
}


def geometry(name):
    """(layers, kv_heads, head_dim, layer_types) read from the config, the textbook way."""
    text = planner.load_config(name).get_text_config(decoder=True)
    kv_heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return text.num_hidden_layers, kv_heads, head_dim, layer_types


def textbook_bytes_per_token(name, bytes_per_value=2):
    layers, kv_heads, head_dim, _ = geometry(name)
    return 2 * layers * kv_heads * head_dim * bytes_per_value


# --- the textbook figures -------------------------------------------------------------------------


def test_llama_31_8b_fp16_is_131072_bytes_per_token_and_4_29_gb_at_32k():
    assert textbook_bytes_per_token("llama-3.1-8b") == 2 * 32 * 8 * 128 * 2 == 131_072
    p = planner.plan("llama-3.1-8b", context=32768)
    assert p.kv_bytes_per_token == 131_072
    assert p.kv_bytes_per_token_excl_residual == p.kv_bytes_per_token_asymptotic == 131_072
    assert p.kv_bytes == 131_072 * 32768 == 4_294_967_296
    assert planner.format_bytes(p.kv_bytes) == "4.29 GB"
    assert p.total_bytes == p.weights_bytes + p.kv_bytes


def test_llama_31_70b_fp16_is_327680_bytes_per_token():
    assert textbook_bytes_per_token("llama-3.1-70b") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert planner.plan("llama-3.1-70b", context=4096).kv_bytes_per_token == 327_680


@pytest.mark.parametrize("name", FULL_ATTENTION_MODELS)
@pytest.mark.parametrize(("kv_format", "bytes_per_value"), [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_full_attention_models_follow_the_textbook_formula(name, kv_format, bytes_per_value):
    per_token = textbook_bytes_per_token(name, bytes_per_value)
    p = planner.plan(name, context=1000, batch=3, kv_format=kv_format)
    assert p.kv_bytes == 3 * 1000 * per_token
    assert p.kv_bytes_per_token == per_token and p.ratio_to_fp16 == bytes_per_value / 2


def test_gqa_geometry_comes_from_the_configs():
    assert geometry("qwen2.5-7b")[:3] == (28, 4, 128)  # 28 query heads share 4 KV heads
    assert geometry("mistral-7b")[:3] == (32, 8, 128)
    assert geometry("gemma-3-27b")[:3] == (62, 16, 128)  # head_dim set explicitly, not 5376 / 32
    assert geometry("gemma-3-4b")[:3] == (34, 4, 256)


# --- shipped configs and weights --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(planner.SHIPPED_CONFIGS))
def test_shipped_configs_load_as_transformers_configs(name):
    config = planner.load_config(name)
    assert isinstance(config, PreTrainedConfig)
    assert config.get_text_config() is config
    assert planner.shipped_config_path(name).is_file()


def test_shipped_config_contents():
    llama = planner.load_config("llama-3.1-8b")
    assert (llama.hidden_size, llama.intermediate_size, llama.vocab_size) == (4096, 14336, 128256)
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 8.0
    assert llama.max_position_embeddings == 131072 and not llama.tie_word_embeddings
    mistral = planner.load_config("mistral-7b")  # v0.3
    assert mistral.vocab_size == 32768 and mistral.sliding_window is None
    assert planner.load_config("MISTRAL-7B-v0.3").vocab_size == 32768
    assert planner.load_config("gemma3-270m").num_key_value_heads == 1  # the spelling the CLI's --model uses
    qwen = planner.load_config("qwen2.5-7b")
    assert qwen.model_type == "qwen2" and set(qwen.layer_types) == {"full_attention"}


@pytest.mark.parametrize("name", GEMMA3)
def test_gemma3_layers_alternate_five_sliding_to_one_full(name):
    config = planner.load_config(name)
    assert config.model_type == "gemma3_text"
    assert config.layer_types == [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(config.num_hidden_layers)
    ]
    assert config.sliding_window == (512 if name == "gemma-3-270m" else 1024)
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_parameter_counts_match_the_published_totals_within_one_percent(name):
    count = planner.count_parameters(planner.load_config(name))
    assert count.method == "formula"
    assert count.total == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.01)


def meta_count(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(planner.SHIPPED_CONFIGS))
def test_parameter_formula_equals_the_instantiated_model(name):
    config = planner.load_config(name)
    assert planner.count_parameters(config).total == meta_count(config)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", dict(attention_bias=True, mlp_bias=True)),
        ("qwen3", dict(attention_bias=True, tie_word_embeddings=True)),
        ("gemma", dict(attention_bias=True)),
        ("gemma2", {}),
        ("gemma3_text", dict(tie_word_embeddings=False)),
        ("qwen2", {}),
        ("mistral", {}),
    ],
)
def test_parameter_formula_covers_biases_norms_and_tying(model_type, extra):
    config = AutoConfig.for_model(
        model_type,
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        **extra,
    )
    assert planner.count_parameters(config).total == meta_count(config)


def test_unknown_families_are_counted_on_the_meta_device():
    config = AutoConfig.for_model(
        "phi3",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    count = planner.count_parameters(config)
    assert count.method == "meta-device model" and count.total == meta_count(config)


@pytest.mark.parametrize(
    ("dtype", "bits"), [("fp32", 32), ("bf16", 16), ("fp16", 16), ("int8", 8), ("int4", 4)]
)
def test_weights_bytes_are_parameters_times_bytes_per_weight(dtype, bits):
    p = planner.plan("llama-3.1-8b", context=1, weights_dtype=dtype)
    assert p.weights_bytes == 8_030_261_248 * bits // 8


# --- sliding windows and budgets ----------------------------------------------------------------


@pytest.mark.parametrize("name", GEMMA3)
def test_gemma3_sliding_layers_saturate_at_their_window(name):
    _, kv_heads, head_dim, layer_types = geometry(name)
    window = planner.load_config(name).sliding_window
    per_layer_token = 2 * kv_heads * head_dim * 2
    n_full, n_sliding = layer_types.count("full_attention"), layer_types.count("sliding_attention")

    short = planner.plan(name, context=window // 2)  # below the window: every layer holds every token
    assert short.kv_bytes == (n_full + n_sliding) * (window // 2) * per_layer_token
    assert short.kv_bytes_per_token == textbook_bytes_per_token(name)

    long = planner.plan(name, context=32768)
    assert long.kv_bytes == (n_full * 32768 + n_sliding * window) * per_layer_token
    held = {k.kind: k.tokens_held for k in long.layer_kinds}
    assert held == {"full": 32768, "sliding": window}
    assert long.kv_bytes_per_token_asymptotic == n_full * per_layer_token
    assert long.kv_bytes_per_token_excl_residual == textbook_bytes_per_token(name)
    assert long.kv_bytes_per_token < long.kv_bytes_per_token_excl_residual


def test_gemma3_27b_at_32k_against_512_tokens():
    # 52 sliding layers (window 1024) + 10 full, 16 KV heads x 128: 8,192 bytes per layer and token in fp16
    assert planner.plan("gemma-3-27b", 512).kv_bytes == 62 * 512 * 8192
    assert planner.plan("gemma-3-27b", 32768).kv_bytes == (52 * 1024 + 10 * 32768) * 8192


def test_budget_caps_every_layer():
    per_token = textbook_bytes_per_token("llama-3.1-8b")
    capped = planner.plan("llama-3.1-8b", context=32768, budget=1024)
    assert capped.kv_bytes == 1024 * per_token and capped.kv_bytes_per_token_asymptotic == 0
    assert planner.plan("llama-3.1-8b", context=500, budget=1024).kv_bytes == 500 * per_token
    # a budget below Gemma's window caps the sliding layers too
    gemma = planner.plan("gemma-3-4b", context=32768, budget=256)
    assert {k.tokens_held for k in gemma.layer_kinds} == {256}
    assert gemma.kv_bytes == 256 * textbook_bytes_per_token("gemma-3-4b")


# --- quantized formats ------------------------------------------------------------------------------


def kivi_bytes_per_head(quantized, recent, head_dim, bits, group, params=2):
    """KIVI layout, written out: packed payload, key scales (+zeros) per channel per token group, value
    scales (+zeros) per token per channel group (fp16 each), fp16 recent window. `params` is 2 for the
    int formats (scale and zero point), 1 for fp8 (a scale only, with `bits` 8: one byte per value)."""
    key_payload = quantized * head_dim * bits / 8
    value_payload = quantized * head_dim * bits / 8
    key_meta = math.ceil(quantized / group) * head_dim * params * 2
    value_meta = quantized * (head_dim // group) * params * 2
    window = recent * head_dim * 2 * 2  # keys + values, fp16
    return key_payload + value_payload + key_meta + value_meta + window


#: (format, bits per value, fp16 parameters per group, QuantizedCache's default group at head_dim 128,
#: the ratio-to-fp16 target the default group is chosen for; fp8 has none).
QUANTIZED = [
    ("int8", 8, 2, 64, 0.56),
    ("int4", 4, 2, 32, 0.32),
    ("int2", 2, 2, 32, 0.19),
    ("fp8", 8, 1, 32, None),
]


@pytest.mark.parametrize(("kv_format", "bits", "params", "group", "bound"), QUANTIZED)
def test_quantized_bytes_per_token_over_fp16_meet_the_targets(kv_format, bits, params, group, bound):
    head_dim = 128
    ratio = kivi_bytes_per_head(group, 0, head_dim, bits, group, params) / group / (2 * head_dim * 2)
    # int: b/16 + 2/G (0.53125, 0.3125, 0.1875); fp8: 1/2 + 1/G (0.53125)
    assert ratio == (bits / 16 + 2 / group if params == 2 else 1 / 2 + 1 / group)
    assert bound is None or ratio <= bound
    p = planner.plan("llama-3.1-8b", context=32768, kv_format=kv_format)
    assert p.ratio_to_fp16 == ratio
    assert p.kv_bytes_per_token_excl_residual == ratio * 131_072
    assert p.group_size == group and p.residual == 128
    # at 32K the last 128 tokens sit in fp16: per token costs more than the stored rate
    expected = 32 * 8 * kivi_bytes_per_head(32768 - 128, 128, head_dim, bits, group, params)
    assert p.kv_bytes == expected
    assert p.kv_bytes_per_token == expected / 32768 > p.kv_bytes_per_token_excl_residual


def test_fp8_is_one_byte_per_value_plus_an_fp16_scale_per_group_and_a_full_precision_window():
    p = planner.plan("llama-3.1-8b", context=32768, kv_format="fp8")
    quantized = 32768 - 128
    key_scales = quantized // 32 * 128 * 2  # one fp16 scale per channel per 32 tokens
    value_scales = quantized * (128 // 32) * 2  # one fp16 scale per 32 channels per token
    per_head = 2 * quantized * 128 + key_scales + value_scales + 128 * 2 * 128 * 2
    assert p.kv_bytes == 32 * 8 * per_head
    assert p.ratio_to_fp16 == 1 / 2 + 1 / 32 and p.residual == 128 and p.group_size == 32
    assert p.layer_kinds[0].tokens_full_precision == 128
    # an explicit group size applies to fp8 too
    assert (
        planner.plan("llama-3.1-8b", context=32768, kv_format="fp8", group_size=64).ratio_to_fp16
        == 1 / 2 + 1 / 64
    )


def test_quantized_partial_groups_small_contexts_and_group_size():
    # 100 tokens, no fp16 window, groups of 32: the key scales cover 4 groups (the last one partial)
    p = planner.plan("llama-3.1-8b", context=100, kv_format="int4", group_size=32, residual=0)
    assert p.kv_bytes == 32 * 8 * kivi_bytes_per_head(100, 0, 128, 4, 32)
    p = planner.plan("llama-3.1-8b", context=100, kv_format="fp8", group_size=32, residual=0)
    assert p.kv_bytes == 32 * 8 * kivi_bytes_per_head(100, 0, 128, 8, 32, params=1)
    # fewer tokens than the window: everything is fp16
    for kv_format in ("int2", "fp8"):
        assert planner.plan("llama-3.1-8b", context=100, kv_format=kv_format).kv_bytes == 100 * 131_072
        assert planner.plan("llama-3.1-8b", context=0, kv_format=kv_format).kv_bytes == 0


@pytest.mark.parametrize("bits", [8, 4, 2, "fp8"])
def test_default_group_is_the_caches_gcd_with_the_head_dims(bits):
    from hf_kvplus.quantized_cache import QuantizedCache

    name = "fp8" if bits == "fp8" else f"int{bits}"
    # head_dim 32 is below int8's default 64: the cache falls back to gcd(64, 32) = 32
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    assert planner.plan(config, 10, kv_format=name).group_size == 32
    assert QuantizedCache(config, bits=bits).format.group_size == 32
    cache_group = QuantizedCache(planner.load_config("llama-3.1-8b"), bits=bits).format.group_size
    assert planner.plan("llama-3.1-8b", 10, kv_format=name).group_size == cache_group


@pytest.mark.parametrize("name", ["llama-3.1-8b", "gemma-3-4b", "smollm2-135m"])
@pytest.mark.parametrize(("kv_format", "bits"), [("int8", 8), ("int4", 4), ("int2", 2), ("fp8", "fp8")])
def test_bytes_per_token_are_the_cache_formats(name, kv_format, bits):
    """The planner's stored rate is `QuantFormat.bytes_per_token` (the layout the kernels write) times
    layers x KV heads, at the group the cache picks. No shipped config mixes head dims."""
    from hf_kvplus.kernels.quant_format import QuantFormat
    from hf_kvplus.quantized_cache import QuantizedCache

    layers, kv_heads, head_dim, _ = geometry(name)
    group = QuantizedCache(planner.load_config(name), bits=bits).format.group_size
    p = planner.plan(name, context=4096, kv_format=kv_format)
    assert p.group_size == group
    expected = layers * kv_heads * QuantFormat(bits, group).bytes_per_token(head_dim)
    assert p.kv_bytes_per_token_excl_residual == expected
    assert p.ratio_to_fp16 == expected / textbook_bytes_per_token(name)


@pytest.mark.parametrize(("kv_format", "bits"), [("int8", 8), ("int4", 4), ("int2", 2), ("fp8", "fp8")])
def test_plan_matches_what_a_quantized_cache_holds(kv_format, bits):
    """A filled QuantizedCache holds, in payload + metadata, exactly the planned KV bytes. The context is
    128 + a multiple of every default group, so the cache's full-precision window holds exactly 128
    tokens (in float16, as the planner counts them)."""
    from hf_kvplus.quantized_cache import QuantizedCache

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, head_dim=64
    )
    context = 128 + 64 * 13
    cache = _filled(QuantizedCache(config, bits=bits), config, context)
    report = cache.memory_report()
    assert report.tokens_held == context
    p = planner.plan(config, context, 1, kv_format=kv_format)
    assert p.group_size == cache.format.group_size and p.layer_kinds[0].tokens_full_precision == 128
    assert p.kv_bytes == report.payload_bytes + report.metadata_bytes


# --- rotated formats ------------------------------------------------------------------------------


def rotated_bytes_per_head(quantized, recent, head_dim, key_bits, value_bits):
    """Rotated layout, written out: every quantized token's key codes (key_bits per channel) and value codes
    (value_bits per channel), packed into bytes, and one fp16 norm for each of the two vectors; no groups.
    The fp16 recent window as for KIVI."""
    codes = quantized * (head_dim * key_bits // 8 + head_dim * value_bits // 8)
    norms = quantized * 2 * 2
    window = recent * head_dim * 2 * 2
    return codes + norms + window


@pytest.mark.parametrize(("kv_format", "key_bits", "value_bits"), [
    ("k4v4", 4, 4), ("k4v2", 4, 2), ("k3v2", 3, 2), ("k2v2", 2, 2), ("k8v1", 8, 1), ("k1v3", 1, 3),
])  # fmt: skip
def test_rotated_bytes_per_token_from_first_principles(kv_format, key_bits, value_bits):
    from hf_kvplus.kernels.rotated_format import RotatedFormat

    # Llama 3.1 8B: 32 layers x 8 KV heads x head_dim 128; k4v2: 64 + 32 bytes of codes + 4 of norms = 100
    per_token = 32 * 8 * (128 * key_bits / 8 + 128 * value_bits / 8 + 4)
    assert per_token == 32 * 8 * RotatedFormat(key_bits, value_bits).bytes_per_token(128)
    if kv_format == "k4v2":
        assert per_token == 32 * 8 * 100 == 25_600
    p = planner.plan("llama-3.1-8b", context=32768, kv_format=kv_format)
    assert p.kv_format == kv_format and p.group_size is None and p.residual == 128
    assert p.kv_bytes_per_token_excl_residual == p.kv_bytes_per_token_asymptotic == per_token
    assert p.ratio_to_fp16 == per_token / 131_072 == (key_bits + value_bits) / 32 + 1 / 128
    # the presets' first 4 tokens and the last 128 at fp16, every other one coded on its own (no groups to round)
    first = 4 if kv_format in ("k4v2", "k3v2", "k2v2") else 0
    assert p.first_tokens == first
    expected = 32 * 8 * rotated_bytes_per_head(32768 - 128 - first, 128 + first, 128, key_bits, value_bits)
    assert p.kv_bytes == expected and p.layer_kinds[0].tokens_full_precision == 128 + first
    assert p.kv_bytes_per_token == expected / 32768 > per_token
    bare = planner.plan("llama-3.1-8b", context=32768, kv_format=kv_format, first_tokens=0)
    assert bare.kv_bytes == 32 * 8 * rotated_bytes_per_head(32768 - 128, 128, 128, key_bits, value_bits)
    # fewer tokens than the window: everything is fp16; no window: everything but the first tokens is coded
    assert planner.plan("llama-3.1-8b", context=100, kv_format=kv_format).kv_bytes == 100 * 131_072
    unwindowed = planner.plan("llama-3.1-8b", context=101, kv_format=kv_format, residual=0)
    assert unwindowed.kv_bytes == (101 - first) * per_token + first * 131_072


def test_rotated_formats_are_named_by_key_and_value_bits():
    from hf_kvplus.formats import parse_bits

    listed = [name for name, fmt in planner.KV_FORMATS.items() if fmt.is_rotated]
    assert listed == ["k4v4", "k4v2", "k3v2", "k2v2"]
    assert planner.kv_format("K4V2") is planner.KV_FORMATS["k4v2"]
    fmt = planner.kv_format(" k8v1 ")  # any pair of 1, 2, 3, 4, 8, not only the listed ones
    assert (fmt.name, fmt.key_bits, fmt.value_bits, fmt.kind) == ("k8v1", 8, 1, "rotated")
    assert fmt.is_quantized and not fmt.is_grouped and fmt.cache_bits == "k8v1" == parse_bits(fmt.cache_bits)
    assert planner.kv_format("int4").value_bits == planner.kv_format("int4").key_bits == 4


@pytest.mark.parametrize("window", [128, 16, 1])
@pytest.mark.parametrize("kv_format", ["k4v2", "k3v2", "k4v4", "k8v1"])
def test_plan_matches_what_a_rotated_cache_holds(kv_format, window):
    """A filled rotated QuantizedCache holds, in payload + metadata, exactly the planned KV bytes: its newest
    `window` tokens and its first tokens (the preset's exact sinks, or none) in float16, every other token coded on
    its own (handed over 32 at a time: a context that leaves a multiple of 32 past the window and the first tokens).
    The planner's default first tokens are the preset's, as the cache's are."""
    from hf_kvplus.quantized_cache import QuantizedCache

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, head_dim=64
    )
    for first_tokens in (None, 0, 8):
        cache = QuantizedCache(config, bits=kv_format, window=window, first_tokens=first_tokens)
        first = cache.layers[0].storage.first
        context = window + first + 32 * 26
        cache = _filled(cache, config, context)
        report = cache.memory_report()
        assert report.tokens_held == context
        p = planner.plan(config, context, 1, kv_format=kv_format, residual=window, first_tokens=first_tokens)
        assert p.first_tokens == first == (4 if first_tokens is None and kv_format in ("k4v2", "k3v2") else first)
        assert p.group_size is None and p.layer_kinds[0].tokens_full_precision == window + first
        # The planner plans the tokens' bytes; a key centre's state (a few tables a layer) is reported apart.
        state = sum(tensor_bytes(list(f.state_tensors(s))) for layer in cache.layers
                for f, s in zip(layer.storage.formats(), layer.storage.states(), strict=True))
        assert p.kv_bytes == report.payload_bytes + report.metadata_bytes - state, first_tokens
    quantized = cache.quantized_report()
    context -= first
    assert quantized["format"] == kv_format and quantized["quantized_tokens"] == context - window
    assert quantized["quantized_bytes"] == (context - window) * p.kv_bytes_per_token_excl_residual
    assert quantized["bytes_per_token"] == p.kv_bytes_per_token_excl_residual
    assert quantized["ratio_to_fp16"] == p.ratio_to_fp16


# --- registered formats -----------------------------------------------------------------------------


@pytest.fixture
def fp4(monkeypatch):
    """The example fp4 format, imported by name as examples/formats/conftest.py imports it (which registers it)."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples" / "formats"))
    return importlib.import_module("fp4_e2m1")


def test_a_registered_format_is_planned_from_its_format_object(fp4):
    """`quantized:fp4` (registered from outside hf_kvplus) plans as the cache holds it: bytes per token are the
    format object's own, and a filled cache's payload + metadata is the plan's KV bytes. The context leaves a whole
    number of 32-token key groups past the 128-token window, as the cache hands tokens over."""
    from hf_kvplus.quantized_cache import QuantizedCache

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, head_dim=64
    )
    fmt = planner.kv_format("FP4")
    assert (fmt.name, fmt.kind, fmt.cache_bits) == ("fp4", "registered", "fp4") and fmt.is_quantized
    context = 128 + 32 * 13
    cache = _filled(QuantizedCache(config, bits="fp4"), config, context)
    report = cache.memory_report()
    assert report.tokens_held == context and cache.format.group_size == 32
    p = planner.plan(config, context, 1, kv_format="fp4")
    assert p.kv_format == "fp4" and p.first_tokens == 0 and p.layer_kinds[0].tokens_full_precision == 128
    per_token = 2 * 2 * fp4.FP4Format(32).bytes_per_token(64)  # 2 layers x 2 KV heads x (64 + 4 x 64 / 32)
    assert per_token == 2 * 2 * 72 and p.kv_bytes_per_token_excl_residual == per_token
    assert p.kv_bytes == report.payload_bytes + report.metadata_bytes
    quantized = cache.quantized_report()
    assert quantized["bytes_per_token"] == p.kv_bytes_per_token_excl_residual
    assert quantized["quantized_bytes"] == 32 * 13 * per_token
    # its maker takes the group size; a head dim it cannot code is refused with its own typed error
    assert planner.plan(config, context, 1, kv_format="fp4", group_size=16).kv_bytes_per_token_excl_residual == (
        2 * 2 * fp4.FP4Format(16).bytes_per_token(64))
    with pytest.raises(ConfigError, match="head_dim 64 must be even and a multiple of the group size 48"):
        planner.plan(config, context, 1, kv_format="fp4", group_size=48)


def test_rotated_formats_ignore_group_size_as_fp16_does():
    """A rotated format has no groups: like fp16 (and unlike `QuantizedCache`, which refuses one), the planner
    ignores `group_size`, so one `--group-size` can serve a mix of KIVI and rotated formats."""
    plain = planner.plan("llama-3.1-8b", 4096, kv_format="k4v2")
    for group_size in (48, 64, 0):
        given = planner.plan("llama-3.1-8b", 4096, kv_format="k4v2", group_size=group_size)
        assert given == plain and given.group_size is None


def test_bad_rotated_formats_raise_typed_errors_with_the_numbers():
    for name, match in [
        ("k5v2", r"KV cache format 'k5v2': key_bits must be one of \(1, 2, 3, 4, 8\).*got 5"),
        ("k4v16", r"KV cache format 'k4v16': value_bits must be one of \(1, 2, 3, 4, 8\).*got 16"),
        ("k0v2", r"key_bits .* got 0"),
        ("k4", r"unknown KV cache format 'k4'; known formats: .*k4v2.*any rotated k<key bits>v<value bits>"),
    ]:
        with pytest.raises(ConfigError, match=match):
            planner.kv_format(name)
        with pytest.raises(ConfigError, match=match):
            planner.plan("llama-3.1-8b", 1024, kv_format=name)
    # head_dim 144 / 4 = 36, not a multiple of 8
    odd = LlamaConfig(hidden_size=144, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    with pytest.raises(ConfigError, match=r"k4v2: head_dim 36 is not a multiple of 8"):
        planner.plan(odd, 1024, kv_format="k4v2")
    with pytest.raises(ConfigError, match=r"k3v2: head_dim 36 is not a multiple of 8"):
        planner.max_context(odd, "1GB", kv_format="k3v2")
    assert planner.plan(odd, 10, kv_format="fp16").kv_bytes == 10 * 2 * 2 * 36 * 2  # fp16 has no such limit
    with pytest.raises(ConfigError, match=r"residual .* got residual=-1"):
        planner.plan("llama-3.1-8b", 1024, kv_format="k4v2", residual=-1)
    with pytest.raises(ConfigError, match=r"first_tokens .* got first_tokens=-1"):
        planner.plan("llama-3.1-8b", 1024, kv_format="k4v2", first_tokens=-1)


# --- largest context and batch ------------------------------------------------------------------------

FIT_CASES = [
    ("llama-3.1-8b", "24GB", 1, "fp16", None),
    ("llama-3.1-8b", "24GiB", 4, "int4", None),
    ("llama-3.1-8b", 20 * 10**9, 2, "fp8", None),
    ("gemma-3-27b", "80GB", 1, "int2", None),
    ("gemma-3-12b", "40GB", 8, "fp16", None),
    ("gemma-3-4b", "9GB", 16, "int8", 2000),
    ("qwen2.5-7b", "18GB", 1, "int4", None),
    ("llama-3.1-8b", "24GB", 2, "k4v2", None),
    ("gemma-3-27b", "80GB", 1, "k3v2", None),
    ("gemma-3-4b", "8.2GB", 16, "k2v2", 2000),
]


@pytest.mark.parametrize(("name", "memory", "batch", "kv_format", "budget"), FIT_CASES)
def test_max_context_fits_and_one_more_token_does_not(name, memory, batch, kv_format, budget):
    limit = planner.parse_memory(memory)
    options = dict(kv_format=kv_format, budget=budget)
    context = planner.max_context(name, memory, batch, **options)
    assert context is not None and context > 0
    assert planner.plan(name, context, batch, **options).total_bytes <= limit
    assert planner.plan(name, context + 1, batch, **options).total_bytes > limit


@pytest.mark.parametrize(("name", "memory", "batch", "kv_format", "budget"), FIT_CASES)
def test_max_batch_fits_and_one_more_sequence_does_not(name, memory, batch, kv_format, budget):
    limit = planner.parse_memory(memory)
    options = dict(kv_format=kv_format, budget=budget)
    sequences = planner.max_batch(name, memory, 8192, **options)
    assert sequences >= 1
    assert planner.plan(name, 8192, sequences, **options).total_bytes <= limit
    assert planner.plan(name, 8192, sequences + 1, **options).total_bytes > limit


def test_llama_8b_in_24gb():
    free = 24 * 10**9 - 2 * 8_030_261_248
    assert planner.max_context("llama-3.1-8b", "24GB") == free // 131_072
    assert planner.max_batch("llama-3.1-8b", "24GB", 32768) == free // (131_072 * 32768) == 1


def test_bounded_caches_fit_any_context():
    assert planner.max_context("llama-3.1-8b", "24GB", budget=4096) is None
    assert planner.max_context("gemma-3-27b", "80GB", batch=4, budget=1024) is None
    # bounded, but the saturated cache does not fit: a finite answer below the bound
    context = planner.max_context("llama-3.1-8b", "16.2GB", budget=4096)
    assert 0 < context < 4096
    assert planner.plan("llama-3.1-8b", context + 1, budget=4096).total_bytes > 16.2e9


def test_nothing_fits():
    with pytest.raises(CapacityError, match=r"weights alone need 141\.11 GB .* more than the 24\.00 GB"):
        planner.max_context("llama-3.1-70b", "24GB")
    with pytest.raises(CapacityError, match="70,553,706,496 parameters in bf16"):
        planner.max_batch("llama-3.1-70b", "24GB", 1024)
    weights = planner.plan("llama-3.1-8b", 0).weights_bytes
    assert planner.max_context("llama-3.1-8b", weights + 131_071) == 0
    assert planner.max_context("llama-3.1-8b", weights + 131_072) == 1
    assert planner.max_batch("llama-3.1-8b", weights + 1000, 1024) == 0


# --- memory strings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("24GiB", 24 * 2**30),
        ("24 gib", 24 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("512MiB", 512 * 2**20),
        ("80G", 80 * 10**9),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_memory_strings(text, expected):
    assert planner.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["24XB", "-1GB", "", "GB", "1.2.3GB", -5, True])
def test_bad_memory_strings_are_refused(text):
    with pytest.raises(ConfigError):
        planner.parse_memory(text)


# --- typed errors -------------------------------------------------------------------------------


def test_bad_inputs_raise_typed_errors_with_the_numbers():
    assert issubclass(ConfigError, KVPlusError)
    with pytest.raises(ConfigError, match=r"unknown KV cache format 'int3'; known formats: fp32, fp16, bf16"):
        planner.plan("llama-3.1-8b", 1024, kv_format="int3")
    with pytest.raises(ConfigError, match=r"group_size 48 does not divide head_dim 128"):
        planner.plan("llama-3.1-8b", 1024, kv_format="int4", group_size=48)
    with pytest.raises(ConfigError, match=r"group_size must be a positive integer for int4, got 0"):
        planner.plan("llama-3.1-8b", 1024, kv_format="int4", group_size=0)
    with pytest.raises(ConfigError, match=r"group_size 48 does not divide head_dim 128: fp8 values"):
        planner.plan("llama-3.1-8b", 1024, kv_format="fp8", group_size=48)
    with pytest.raises(ConfigError, match=r"at least 1 token per layer, got budget=0"):
        planner.plan("llama-3.1-8b", 1024, budget=0)
    with pytest.raises(ConfigError, match=r"non-negative number of tokens, got context=-1"):
        planner.plan("llama-3.1-8b", -1)
    with pytest.raises(ConfigError, match=r"batch must be at least 1 sequence, got batch=0"):
        planner.plan("llama-3.1-8b", 1024, batch=0)
    with pytest.raises(ConfigError, match=r"residual .* got residual=-2"):
        planner.plan("llama-3.1-8b", 1024, kv_format="int8", residual=-2)
    with pytest.raises(ConfigError, match=r"unknown weights dtype 'int3'"):
        planner.plan("llama-3.1-8b", 1024, weights_dtype="int3")
    with pytest.raises(ConfigError, match=r"unknown model 'llama-9b'.*llama-3\.1-8b, llama-3\.1-70b"):
        planner.plan("llama-9b", 1024)
    # group size is irrelevant to unquantized formats
    assert planner.plan("llama-3.1-8b", 8, group_size=48).kv_bytes == 8 * 131_072


def test_models_the_caches_cannot_serve_are_refused():
    config = LlamaConfig(hidden_size=1024, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(UnsupportedModelError, match="head_dim 512"):
        planner.plan(config, 1024)


# --- loading configs ----------------------------------------------------------------------------


def test_load_config_from_a_file_a_folder_or_an_object(tmp_path):
    source = planner.shipped_config_path("qwen2.5-7b")
    shutil.copy(source, tmp_path / "config.json")
    from_folder = planner.load_config(tmp_path)
    from_file = planner.load_config(str(tmp_path / "config.json"))

    def contents(config):
        return {k: v for k, v in config.to_diff_dict().items() if k != "_name_or_path"}

    assert contents(from_folder) == contents(from_file) == contents(planner.load_config("qwen2.5-7b"))
    assert planner.load_config(from_folder) is from_folder
    assert planner.plan(str(tmp_path), 10).kv_bytes == planner.plan("qwen2.5-7b", 10).kv_bytes
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        planner.load_config(tmp_path / "empty")


def test_hub_ids_go_through_autoconfig(monkeypatch):
    from hf_kvplus.planning import configs

    asked = []

    def from_pretrained(name, *args, **kwargs):
        asked.append(name)
        if name == "meta-llama/Llama-3.1-8B":
            raise OSError("offline")
        return LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=256)

    monkeypatch.setattr(configs.AutoConfig, "from_pretrained", from_pretrained)
    assert planner.plan("someone/tiny-llama", 10).kv_bytes == 10 * 2 * 2 * 2 * 64 * 2
    with pytest.raises(ConfigError, match=r"hub \(shipped offline as 'llama-3\.1-8b'\): offline"):
        planner.load_config("meta-llama/Llama-3.1-8B")
    assert asked == ["someone/tiny-llama", "meta-llama/Llama-3.1-8B"]


# --- the plan against a real cache ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_plan_matches_what_a_dense_cache_holds(arch):
    """Full layers hold what the plan says; sliding layers hold window - 1 between steps, the plan
    counts the peak of a decode step (window)."""
    config, model = make_config(arch), build_model(arch)
    tokens, batch = 40, 2
    cache = DenseCache(config=config)
    with torch.no_grad():
        model(torch.randint(3, 100, (batch, tokens)), **cache_kwargs(cache), use_cache=True)
    p = planner.plan(config, tokens, batch, kv_format="fp32")
    held = {k.kind: k.tokens_held for k in p.layer_kinds}
    per_token = {}
    for layer in cache.layers:
        report = layer.memory()
        kind = layer.spec.kind
        expected = held[kind] - (1 if kind == "sliding" and held[kind] == layer.spec.window else 0)
        assert report.tokens_held == expected
        per_token[kind] = report.payload_bytes // (batch * report.tokens_held)
    saturated = sum(
        k.num_layers * per_token[k.kind] * batch
        for k in p.layer_kinds
        if k.kind == "sliding" and k.tokens_held == k.window
    )
    assert p.kv_bytes == cache.memory_report().payload_bytes + saturated


def test_plan_is_frozen():
    p = planner.plan("llama-3.1-8b", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.kv_bytes = 0
    assert json.loads(json.dumps(p.to_dict()))["total_bytes"] == p.total_bytes


# --- command line -------------------------------------------------------------------------------


def cli(*argv):
    parser = argparse.ArgumentParser(prog="kvplus")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_cli_prints_a_table_per_format_and_writes_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["llama-3.1-8b", "--context", "32768", "--format", "fp16", "int4", "fp8", "--memory", "24GB"]
    assert cli(*argv, "--json", str(path)) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[1:2] in (["fp16"], ["int4"], ["fp8"])]
    assert [row.split()[1] for row in rows] == ["fp16", "int4", "fp8"]
    fp16 = rows[0].split()
    assert fp16[2:5] == ["32,768", "1", "131,072"] and "4.29 GB" in rows[0]
    assert f"{planner.max_context('llama-3.1-8b', '24GB'):,}" in rows[0]
    document = json.loads(path.read_text())
    assert document["memory_bytes"] == 24 * 10**9
    int4 = document["plans"][1]
    assert int4["kv_bytes"] == planner.plan("llama-3.1-8b", 32768, kv_format="int4").kv_bytes
    assert int4["max_context"] == planner.max_context("llama-3.1-8b", "24GB", kv_format="int4")
    assert int4["max_batch"] == planner.max_batch("llama-3.1-8b", "24GB", 32768, kv_format="int4")


def test_cli_compares_rotated_formats(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["llama-3.1-8b", "--format", "fp16", "int4", "k4v2", "K3V2", "k8v1", "--memory", "80GB"]
    assert cli(*argv, "--json", str(path)) == 0
    out = capsys.readouterr().out
    names = ["fp16", "int4", "k4v2", "k3v2", "k8v1"]
    rows = {line.split()[1]: line for line in out.splitlines() if set(line.split()[1:2]) & set(names)}
    assert list(rows) == names
    # the preset's first 4 tokens and the last 128 at fp16 (131,072 bytes a token), the rest at 25,600
    per_token = ((32768 - 132) * 25_600 + 132 * 131_072) / 32768
    assert rows["k4v2"].split()[2:6] == ["32,768", "1", f"{per_token:,.1f}", "25,600"] and "0.195" in rows["k4v2"]
    assert "the last 128 tokens and the first 4 of each row (k4v2/k3v2) at full precision" in " ".join(out.split())
    assert "k4v2/k3v2/k8v1: rotated" in out and "one fp16 norm per vector" in " ".join(out.split())
    record = json.loads(path.read_text())["plans"][2]
    assert record["kv_format"] == "k4v2" and record["group_size"] is None and record["residual"] == 128
    assert record["kv_bytes"] == 32 * 8 * rotated_bytes_per_head(32768 - 132, 132, 128, 4, 2)
    assert record["first_tokens"] == 4
    assert cli(*argv, "--first-tokens", "0", "--json", str(path)) == 0
    capsys.readouterr()
    record = json.loads(path.read_text())["plans"][2]
    assert record["kv_bytes"] == 32 * 8 * rotated_bytes_per_head(32768 - 128, 128, 128, 4, 2)
    assert record["max_context"] == planner.max_context("llama-3.1-8b", "80GB", kv_format="k4v2", first_tokens=0)
    assert record["max_batch"] == planner.max_batch("llama-3.1-8b", "80GB", 32768, kv_format="k4v2", first_tokens=0)
    # one --group-size for a mix: the KIVI formats take it, the rotated ones have no groups
    assert cli("llama-3.1-8b", "--format", "int4", "k4v2", "--group-size", "64", "--json", "-") == 0
    out = capsys.readouterr().out
    plans = json.loads(out[out.index("{") :])["plans"]
    assert [(p["kv_format"], p["group_size"]) for p in plans] == [("int4", 64), ("k4v2", None)]
    assert "(--group-size does not apply)" in " ".join(out.split())


def test_cli_refuses_bad_rotated_formats(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli("llama-3.1-8b", "--format", "fp16", "k5v2")
    assert "KV cache format 'k5v2': key_bits must be one of (1, 2, 3, 4, 8)" in capsys.readouterr().err
    odd = LlamaConfig(hidden_size=144, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    odd.save_pretrained(tmp_path)
    assert cli(str(tmp_path), "--format", "fp16", "k4v2") == 2
    assert "k4v2: head_dim 36 is not a multiple of 8" in capsys.readouterr().err


def test_cli_reports_bounded_caches_and_weights_that_do_not_fit(capsys):
    assert cli("gemma-3-27b", "--budget", "1024", "--memory", "80GB") == 0
    assert "any (bounded KV)" in capsys.readouterr().out
    assert cli("llama-3.1-70b", "--memory", "24GB", "--json", "-") == 0
    out = capsys.readouterr().out
    assert "weights > memory" in out
    assert json.loads(out[out.index("{") :])["plans"][0]["weights_fit"] is False


def test_cli_errors(capsys):
    assert cli("no-such-model") == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert cli("llama-3.1-8b", "--format", "int4", "--group-size", "48") == 2
    assert "group_size 48 does not divide head_dim 128" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli("llama-3.1-8b", "--memory", "24XB")


# --- tensor parallel ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", ["fp16", "int4", "k4v2"])
def test_tp_splits_the_kv_heads_and_weights_per_rank(kv_format):
    """Llama 3.1 8B has 8 KV heads: over 2 ranks each holds 4 of every layer's, so half of every KV byte, and
    half the weights (rounded up)."""
    whole = planner.plan("llama-3.1-8b", 32768, kv_format=kv_format)
    rank = planner.plan("llama-3.1-8b", 32768, kv_format=kv_format, tp=2)
    assert rank.tp == 2 and whole.tp == 1
    assert [k.num_kv_heads for k in rank.layer_kinds] == [4] and [k.num_kv_heads for k in whole.layer_kinds] == [8]
    assert 2 * rank.kv_bytes == whole.kv_bytes
    assert 2 * rank.kv_bytes_per_token_excl_residual == whole.kv_bytes_per_token_excl_residual
    assert rank.ratio_to_fp16 == whole.ratio_to_fp16
    assert rank.weights_bytes == -(-whole.weights_bytes // 2)
    # A rank's memory fits twice the batch one device's does (the weights halve too, so at least that).
    assert planner.max_batch("llama-3.1-8b", "24GB", 32768, tp=2) >= 2 * planner.max_batch("llama-3.1-8b", "24GB", 32768)


def test_tp_divides_a_small_config_per_rank():
    """Half the KV bytes over 2 ranks, one KV head each over 4 (what a rank holds: test_tensor_parallel.py)."""
    config = LlamaConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_hidden_layers=2)
    assert 2 * planner.plan(config, 100, kv_format="fp32", tp=2).kv_bytes == planner.plan(config, 100, kv_format="fp32").kv_bytes
    assert planner.plan(config, 100, tp=4).layer_kinds[0].num_kv_heads == 1


def test_tp_that_does_not_divide_the_heads_is_refused(capsys):
    with pytest.raises(ConfigError, match="8 KV heads cannot be split evenly over tp=3"):
        planner.plan("llama-3.1-8b", 100, tp=3)
    with pytest.raises(ConfigError, match="tp=0"):
        planner.max_context("llama-3.1-8b", "24GB", tp=0)
    assert cli("llama-3.1-8b", "--tp", "3") == 2
    assert "cannot be split evenly over tp=3" in capsys.readouterr().err
    assert cli("llama-3.1-8b", "--tp", "2", "--memory", "24GB") == 0
    out = capsys.readouterr().out
    assert "per rank of tp=2" in out and "on each of 2 ranks" in out


def _filled(cache, config, context: int):
    """`cache` after one update of `context` random float16 tokens per layer (2 KV heads, head_dim 64)."""
    generator = torch.Generator().manual_seed(0)
    for layer in range(config.num_hidden_layers):
        k, v = (torch.randn(1, 2, context, 64, generator=generator, device="cpu").half() for _ in range(2))
        cache.update(k, v, layer)
    return cache
