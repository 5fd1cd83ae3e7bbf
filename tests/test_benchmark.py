"""The benchmark measures every spec with the baseline in the same run and reads bytes off the caches."""

import torch

from conformance.models import build_model
from hf_kvplus.evaluation import benchmark, format_table, plot_bench
from hf_kvplus.evaluation.benchmark import BENCH_COLUMNS
from hf_kvplus.specs import parse_cache_spec


def test_benchmark_rows(tmp_path):
    model = build_model("llama")
    specs = [parse_cache_spec(s) for s in ("dynamic", "dense", "hf-quantized:quanto:2:residual=8")]
    prompt = torch.randint(3, 128, (2, 40))
    results = benchmark(model, prompt, specs, new_tokens=6, repeats=2, warmup=1, progress=False)
    assert [r.cache for r in results] == ["dynamic", "dense", "hf-quantized:quanto:2:residual=8"]
    dynamic, dense, quantized = results
    assert dynamic.decode_vs_baseline == 1.0 and dense.same_tokens_as_baseline
    # DynamicCache holds exactly its tokens: 2 (K, V) x layers x kv_heads x head_dim x 4 bytes, per row.
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert dynamic.bytes_per_token == per_token
    assert dense.bytes_per_token >= per_token
    assert quantized.bytes_per_token < per_token / 2
    assert all(r.decode_tok_s > 0 and r.prefill_s > 0 for r in results)
    table = format_table([r.__dict__ for r in results], BENCH_COLUMNS)
    assert table.splitlines()[0].split()[:2] == ["cache", "prefill"] and len(table.splitlines()) == 5
    plot_bench(results, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_static_cache_bytes_per_token_is_a_number():
    """StaticCache reports its length as a tensor; the benchmark's bytes per token stay a float (JSON number)."""
    model = build_model("llama")
    result = benchmark(model, torch.randint(3, 128, (1, 20)), [parse_cache_spec("static")], new_tokens=3, repeats=1,
                       warmup=0, progress=False)[0]  # fmt: skip
    assert type(result.bytes_per_token) is float and result.bytes_per_token > 0
