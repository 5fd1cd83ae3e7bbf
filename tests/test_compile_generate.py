"""SinkCache, H2OCache, DenseCache(max_tokens=N) and PagedCache(max_tokens=N) built with `compileable=True` declare
`is_compileable`, so `generate()` compiles the decode forward as it does for StaticCache.

The evicting caches' budget fixes the slots' shape once full; the static dense and paged storages read all N
positions every step (the paged one through block tables reserved at the first fill). Their counts are on the device
(`tests/test_compile_static_graph.py` checks that the decode step compiles once); an evicting cache whose slots fill
during decode compiles again while they do. `generate()` then builds masks outside the graph and calls the compiled
forward for every decode step; on CPU it does so only with `CompileConfig._compile_all_devices`. The
backend records each graph it is handed and runs it as traced (dynamo's capture with the eager ops, so
tokens must match eager `generate()` exactly); `fullgraph=True` makes any graph break an error.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, DynamicCache

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import DenseCache, H2OCache, Offloaded, PagedCache, SinkCache, cache_kwargs
from hf_kvplus.errors import ConfigError, UnsupportedModelError
from hf_kvplus.specs import parse_cache_spec

COMPILEABLE = ["dense:max_tokens=64:compile=on", "paged:max_tokens=64:block=8:compile=on", "quantized:int4:group=8:window=8:max_tokens=64:compile=on", "sink:2:6:compile=on", "sink:2:6:bits=int4:group=8:compile=on", "h2o:8:compile=on", "h2o:8:bits=fp8:compile=on", "quantized:k4v2:window=8:max_tokens=64:compile=on", "sink:2:6:bits=k3v2:compile=on"]
NEW_TOKENS = 24
GRAPHS: list[torch.fx.GraphModule] = []


def recording_backend(gm, example_inputs, **kwargs):
    GRAPHS.append(gm)
    return gm.forward


def compile_config() -> CompileConfig:
    config = CompileConfig(backend=recording_backend, fullgraph=True, mode=None)
    config._compile_all_devices = True  # generate() compiles on CUDA only, unless told
    return config


@pytest.mark.parametrize("spec", COMPILEABLE)
def test_generate_compiles_the_decode_step_of_compileable_caches(spec):
    """24 new tokens, past groups, windows and evictions several times over; a left-padded batch of each spec, 9 new
    tokens and one graph that CUDA graphs can capture: `test_compile_static_graph.py`."""
    torch._dynamo.reset()
    GRAPHS.clear()
    model = get_model("llama")
    ids = make_prompt(13, batch=2)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    cache_spec = parse_cache_spec(spec)
    with torch.no_grad():
        eager = model.generate(ids, **cache_kwargs(cache_spec.build(model.config)), disable_compile=True, **kwargs)
        assert not GRAPHS
        cache = cache_spec.build(model.config)
        assert cache.is_compileable
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            compiled = model.generate(ids, **cache_kwargs(cache), compile_config=compile_config(), **kwargs)
    assert torch.equal(compiled, eager)
    # The decode steps ran compiled, and recompiled at most while the slots filled, not once per step.
    assert 1 <= len(GRAPHS) <= 3, f"{len(GRAPHS)} graphs for {NEW_TOKENS} tokens"


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("spec", ["sink:2:8", "sink:2:11", "sink:2:20", "sink:2:20:bits=int4:group=8", "h2o:13", "h2o:20"])
def test_a_compileable_evicting_cache_keeps_what_the_other_keeps(spec, padded):
    """A compileable evicting cache holds `budget + 1` slots from the prompt on, the unused ones free, and its mask is
    as wide as its slots: its decode (eager here) gives the tokens of the same cache that grows its slots and sizes
    the mask by the tokens held, for a prompt (13 tokens) longer than the budget (10), of the budget (13) and shorter
    (20, 22: the slots fill during the decode, then evict)."""
    model = get_model("llama")
    ids = make_prompt(13, batch=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, disable_compile=True)
    with torch.no_grad():
        tokens = [model.generate(ids, **cache_kwargs(parse_cache_spec(text).build(model.config)), **kwargs)
                  for text in (spec, spec + ":compile=on")]  # fmt: skip
    assert torch.equal(tokens[1], tokens[0])


def test_a_compiled_static_paged_cache_serves_samples_that_share_their_prompt():
    """Three samples per prompt share the prompt's full blocks and own the rest of their reserved tables: the
    compiled steps write there in place, and the tokens are DynamicCache's under the same seed."""
    torch._dynamo.reset()
    GRAPHS.clear()
    model = get_model("llama")
    ids = make_prompt(13, batch=2)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=5, num_return_sequences=3, pad_token_id=0)
    cache = PagedCache(model.config, block_size=8, max_tokens=40, compileable=True)
    with torch.no_grad():
        torch.manual_seed(0)
        want = model.generate(ids, **cache_kwargs(DynamicCache()), disable_compile=True, **kwargs)
        torch.manual_seed(0)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            got = model.generate(ids, **cache_kwargs(cache), compile_config=compile_config(), **kwargs)
    assert torch.equal(got, want)
    assert 1 <= len(GRAPHS) <= 3
    tables = cache.groups["full"].tables
    assert tables[0][0] == tables[1][0] == tables[2][0] != tables[3][0]  # block 0 of each prompt, stored once


@pytest.mark.parametrize("spec", ["dense", "paged", "quantized:int4", "offloaded", "snapkv:8:observation=4", "sink:2:6", "h2o:8"])
def test_other_caches_are_not_compileable(spec):
    """Growing shapes (dense, paged, quantized, offloaded, SnapKV's decode appends) stay eager, and so do
    SinkCache and H2OCache unless asked: a compileable cache's eager steps get a full mask every step."""
    assert not parse_cache_spec(spec).build(get_model("llama").config).is_compileable


def test_compileable_is_refused_where_it_cannot_hold():
    with pytest.raises(ConfigError, match="K/V on the device"):
        SinkCache(get_model("llama").config, num_sinks=2, window=6, placement=Offloaded(), compileable=True)
    with pytest.raises(UnsupportedModelError, match=r"layers \[0, 1, 3\] .* sliding-window"):
        H2OCache(get_model("gemma3").config, budget=8, compileable=True)
    with pytest.raises(ConfigError, match="compile"):
        parse_cache_spec("sink:2:6:compile=yes")
    with pytest.raises(ConfigError, match="needs max_tokens"):
        DenseCache(get_model("llama").config, compileable=True)
    with pytest.raises(UnsupportedModelError, match=r"layers \[0, 1, 3\] .* sliding-window"):
        DenseCache(get_model("gemma3").config, max_tokens=64, compileable=True)
    with pytest.raises(ConfigError, match="compile must be one of"):
        parse_cache_spec("dense:max_tokens=64:compile=yes")
    with pytest.raises(UnsupportedModelError, match=r"layers \[0, 1, 3\] .* sliding-window"):
        PagedCache(get_model("gemma3").config, max_tokens=64, compileable=True)
    with pytest.raises(ConfigError, match="K/V on the device"):
        PagedCache(get_model("llama").config, max_tokens=64, placement=Offloaded(), compileable=True)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_a_static_dense_cache_is_lossless_and_reads_its_whole_buffer(padded):
    """Eager, the static dense cache gives DynamicCache's tokens, with every read and mask spanning max_tokens."""
    model = get_model("llama")
    ids = make_prompt(13, batch=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, disable_compile=True)
    cache = DenseCache(model.config, max_tokens=40, compileable=True)
    with torch.no_grad():
        want = model.generate(ids, **cache_kwargs(DynamicCache()), **kwargs)
        got = model.generate(ids, **cache_kwargs(cache), **kwargs)
    assert torch.equal(got, want)
    layer = cache.layers[0]
    assert layer.get_mask_sizes(1) == (40, 0) and layer.get_max_length() == 40 and layer.get_seq_length() == 24
    keys, _ = layer.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16))
    assert keys.shape[2] == 40


#: Ops that make a new tensor instead of writing one: after inductor's reinplacing, a cache-sized one is a copy.
COPYING_OPS = frozenset({"index_put", "index_copy", "index_fill", "scatter", "slice_scatter", "select_scatter",
                         "as_strided_scatter", "copy", "clone"})  # fmt: skip


@pytest.mark.parametrize("spec", ["sink:2:6:compile=on", "h2o:8:compile=on", "quantized:int4:group=8:window=8:max_tokens=64:compile=on"])
def test_a_compiled_decode_step_writes_the_cache_in_place(spec):
    """After inductor's own post-grad passes (which turn functional writes back into in-place ones where they
    can), no op of a decode step's graph makes a tensor the size of a cache field: a step that wrote a field
    twice through views (a refill, then an eviction) had inductor copy every layer's keys and positions, 0.7 ms
    of a 7.4 ms step at 1K tokens. The graphs run as traced (no code generation: the check is on the graph)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import post_grad_passes
    from torch._inductor.virtualized import V

    made: list[tuple[str, int]] = []
    graphs: list[torch.fx.GraphModule] = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm)
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            post_grad_passes(gm, is_inference=True)
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and getattr(node.target, "_opname", None) in COPYING_OPS:
                made.append((str(node.target), value.numel()))
        return gm

    torch._dynamo.reset()
    model = get_model("llama")
    ids = make_prompt(13, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    cache = parse_cache_spec(spec).build(model.config)
    config = CompileConfig(fullgraph=True, mode=None, backend=aot_autograd(
        fw_compiler=forward_compiler, decompositions=select_decomp_table(), keep_inference_input_mutations=True))
    config._compile_all_devices = True
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=4, do_sample=False,
                       pad_token_id=0, compile_config=config)  # fmt: skip
    assert graphs, "no decode step was compiled"
    fields = {t.numel() for layer in cache.layers for t in layer.storage.tensors().values()}
    assert not [(op, n) for op, n in made if n in fields]


@pytest.mark.parametrize("spec", ["sink:2:6:compile=on", "h2o:8:compile=on", "paged:max_tokens=64:block=8:compile=on"])
def test_generate_on_cuda_compiles_with_its_default_config(device, spec):
    """On CUDA, generate() compiles a compileable cache's forward unasked, with inductor and CUDA graphs
    ("reduce-overhead"): the tokens must be the eager ones."""
    if device.type != "cuda":
        pytest.skip("CUDA-only path: run with --device cuda on a machine with a GPU")
    torch._dynamo.reset()
    model = get_model("llama")
    ids = make_prompt(13, batch=2)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    cache_spec = parse_cache_spec(spec)
    with torch.no_grad():
        eager = model.generate(ids, **cache_kwargs(cache_spec.build(model.config)), disable_compile=True, **kwargs)
        compiled = model.generate(ids, **cache_kwargs(cache_spec.build(model.config)), **kwargs)
    assert torch.equal(compiled, eager)
