"""The fp4 e2m1 format written outside hf_kvplus: its codes against a hand-computed quantizer, its error bound, its
registration by import, and `generate()` through spec strings, eager and compiled.

Run: ``.venv/bin/python -m pytest examples/formats -q -n 0``.
"""

import fp4_e2m1
import pytest
import torch
from test_compile_fullgraph import greedy  # (tests/ is on pytest's path: eight greedy steps, any forward)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_kvplus import QuantizedCache, cache_kwargs
from hf_kvplus.formats import parse_bits, resolve_format
from hf_kvplus.kernels.dispatch import quantized_decode_attention
from hf_kvplus.kernels.quant_format import PackedKV
from hf_kvplus.model_spec import ModelSpec
from hf_kvplus.specs import parse_cache_spec

SEED = 20261129


def config(head_dim=16) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, head_dim=head_dim,
        vocab_size=128, intermediate_size=128, initializer_range=0.2, attn_implementation="sdpa",
    )  # fmt: skip


def model() -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config()).eval()


def hand_quantized(x: torch.Tensor, group: int, side: str) -> torch.Tensor:
    """fp4 e2m1 by hand, in float64: each group's scale (amax / 6 rounded up to float16), then the nearest of the 16
    signed e2m1 values (a tie to the smaller magnitude), times the scale."""
    axis = -2 if side == "keys" else -1
    xg = x.double().unflatten(axis, (-1, group))
    amax = xg.abs().amax(dim=axis, keepdim=True)
    scale = (amax / 6 * (1 + 2.0**-10) + 2.0**-25).clamp_min(2.0**-24).half().double()
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    y = (xg / scale).unsqueeze(-1)
    nearest = grid[(y.abs() - grid).abs().argmin(dim=-1)] * torch.sign(y.squeeze(-1))
    return (nearest * scale).flatten(axis - 1, axis)


@pytest.mark.parametrize("side", ["keys", "values"])
@pytest.mark.parametrize("group", [8, 16])
def test_codes_are_the_hand_computed_quantizer(side, group):
    g = torch.Generator().manual_seed(SEED + group)
    x = (torch.randn(2, 3, 32, 32, generator=g) * torch.logspace(-2, 2, 32)).to(torch.float16)
    fmt = fp4_e2m1.FP4Format(group)
    codes, scale, zero = fmt.quantize(x, side)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 32, 16) and zero is None
    assert scale.shape == (2, 3, *fmt.param_shape(side, 32, 32))
    got = fmt.dequantize(codes, scale, zero, side, torch.float64)
    torch.testing.assert_close(got, hand_quantized(x, group, side), rtol=0, atol=0)


def test_error_within_the_stated_bound():
    """|x - x^| <= max(s / 4, |x| / 4) per element; on Gaussian data in groups of 32 the relative
    error is about 0.1."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(4, 2, 64, 64, generator=g)
    fmt = fp4_e2m1.FP4Format(32)
    for side in ("keys", "values"):
        codes, scale, _ = fmt.quantize(x, side)
        error = (fmt.dequantize(codes, scale, None, side) - x).abs()
        s = scale.float().repeat_interleave(32, dim=-2 if side == "keys" else -1)
        assert (error <= torch.maximum(s / 4, x.abs() / 4) * (1 + 1e-6)).all()
        assert 0.07 < float(error.norm() / x.norm()) < 0.12


def test_registered_by_importing_its_file():
    assert parse_bits("fp4") == parse_bits("FP4") == "fp4"
    fmt = resolve_format(ModelSpec.from_config(config()), "fp4", None)
    assert fmt == fp4_e2m1.FP4Format(16)  # the default group, reduced to divide head_dim 16
    assert fmt.bytes_per_token(64) == 64 + 4 * 64 / 16  # codes, then a float16 scale per 16 keys and per 16 values


def test_decode_attention_reads_the_codes_as_dequantized_attention():
    """The twin decode over fp4 codes and a full-precision residual equals SDPA over the dequantized keys."""
    g = torch.Generator().manual_seed(SEED)
    fmt = fp4_e2m1.FP4Format(8)
    k, v, q = torch.randn(2, 2, 32, 16, generator=g), torch.randn(2, 2, 32, 16, generator=g), torch.randn(2, 4, 16)
    packed = PackedKV(*fmt.quantize(k, "keys"), *fmt.quantize(v, "values"))
    out = quantized_decode_attention(q, packed, fmt, start=0, length=32, scale=0.25)
    keys = fmt.dequantize(packed.k, packed.k_scale, None, "keys").repeat_interleave(2, dim=1)
    values = fmt.dequantize(packed.v, packed.v_scale, None, "values").repeat_interleave(2, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, scale=0.25)[:, :, 0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def step_error(m, spec: str, ids) -> float:
    """Relative error of a decode step's logits after a prompt cached under `spec`, against full precision."""
    cache = parse_cache_spec(spec).build(m.config)
    with torch.no_grad():
        full = m(input_ids=ids, **cache_kwargs(DynamicCache())).logits[:, -1]
        m(input_ids=ids[:, :-1], **cache_kwargs(cache))
        step = m(input_ids=ids[:, -1:], **cache_kwargs(cache)).logits[:, -1]
    return float((step - full).norm() / full.norm())


def test_generate_by_spec_string_between_the_kivi_widths():
    """On the tiny model a decode step's logits move by 0.25 under fp4 codes (groups of 8), between int4's 0.13 and
    int2's 0.57: an e2m1 grid has 15 levels, finer near 0 and coarser at the ends than int4's 16 uniform ones."""
    m = model()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(SEED))
    cache = parse_cache_spec("quantized:fp4:group=8:window=8").build(m.config)
    with torch.no_grad():
        m(input_ids=ids, **cache_kwargs(cache))
    assert isinstance(cache.layers[0].storage.fmt, fp4_e2m1.FP4Format)
    report = cache.quantized_report()  # bytes at rest of the codes: the format's own figure, 2 layers x 2 heads
    assert report["quantized_tokens"] > 0 and report["bytes_per_token"] == 4 * fp4_e2m1.FP4Format(8).bytes_per_token(16)
    errors = {bits: step_error(m, f"quantized:{bits}:group=8:window=8", ids) for bits in ("int4", "fp4", "int2")}
    assert errors["int4"] < errors["fp4"] < 0.3 < errors["int2"], errors
    out = m.generate(ids, cache=QuantizedCache(m.config, bits="fp4", group_size=8, window=8), max_new_tokens=6,
                     do_sample=False)  # fmt: skip
    assert out.shape == (2, 46)


def test_static_storage_compiles_as_one_graph():
    torch._dynamo.reset()
    m = model()
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(SEED))
    spec = parse_cache_spec("quantized:fp4:group=8:window=8:max_tokens=64:compile=on")
    eager = greedy(m, spec.build(m.config), ids, m)
    compiled = torch.compile(m.forward, backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8):
        assert greedy(m, spec.build(m.config), ids, compiled) == eager
