"""A static cache's compiled decode is one graph that CUDA graphs can capture, as StaticCache's is.

Inductor captures a compiled graph as a CUDA graph only when every input the graph writes in place is at a
static address (`torch._dynamo.mark_static_address`), and it records the graph again for every value of an int
input ("N distinct sizes"). So through `generate()`, which compiles the decode forward of a cache that declares
`is_compileable`, each static cache must over a greedy decode of several steps: compile its decode step once, give
the graph no int input, write only inputs marked static, take no tensor that an earlier call of the graph returned,
and produce the eager decode's tokens. (A CUDA graph's outputs live in its memory pool and its next replay
overwrites them: a tensor one step leaves on the cache for the next, such as a freed slot's index, must be written
into a buffer of the cache's, or the replay fails with "accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run", as the evicting caches once did on an H200.) The backend here records the
graph dynamo hands over (what inductor would receive) and runs it as it is, so the test runs on the CPU; on a GPU,
`eval/bench_compile.py --gpu-pass` times the captured graphs.

StaticCache is the control (it meets every condition); a DenseCache that grows, which `generate()` may also be
told to compile, is the counter-example the checks must catch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StaticCache

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import DenseCache, cache_kwargs
from hf_kvplus.kernels import rotated_cpu
from hf_kvplus.specs import parse_cache_spec

PROMPT, NEW = 21, 10  # 9 decode steps: past several key groups of 8 and the window of 8 of the quantized specs
STATIC_SPECS = [
    "dense:compile=on",
    "paged:block=8:compile=on",
    "quantized:int4:group=8:window=8:compile=on",
    "quantized:k4v2:window=8:compile=on",
    "quantized:int4:group=8:window=8:compile=on:first=4",
    "sink:2:6:compile=on",  # the prompts are longer than the evicting caches' budgets
    "sink:2:6:bits=int4:group=8:compile=on",
    "sink:2:6:bits=k3v2:compile=on",
    "h2o:8:compile=on",
    "h2o:8:bits=fp8:compile=on",
    "sink:2:6:bits=int4:group=8:first=0:compile=on",  # the sinks coded too (the default keeps them exact)
    "h2o:8:recent=4:bits=k4v2:first=2:compile=on",
]


def graph_recorder() -> tuple[list[dict], Callable]:
    """A dynamo backend that keeps each graph it is given with what its inputs are, and runs the graph unchanged.
    (A function, not an object: `CompileConfig` deep-copies its backend, which copies an object but not a
    function and its closure.)"""
    graphs: list[dict] = []
    returned: dict[int, torch.Tensor] = {}  # what the graphs returned, by storage address; kept alive, so no later
    # tensor takes an address

    def backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs):
        names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
        # (An int input may come as a SymInt, which eager ops refuse: its value then.)
        copies = [x.clone() if isinstance(x, torch.Tensor) else int(x) if isinstance(x, torch.SymInt) else x
                  for x in example_inputs]  # fmt: skip
        versions = [x._version if isinstance(x, torch.Tensor) else None for x in copies]
        gm(*copies)  # one step on copies: which inputs does the graph write in place (their version counters move)?
        inputs = list(zip(names, example_inputs, copies, versions, strict=True))
        # (Not by comparing values: a buffer allocated where an earlier run's was can hold the very values written.)
        written = [(name, x) for name, x, copy, v in inputs if isinstance(x, torch.Tensor) and copy._version != v]
        graph = {
            "int_inputs": [name for name, x, _, _ in inputs if not isinstance(x, torch.Tensor)],
            "written": [name for name, _ in written],
            "written_not_static": [name for name, x in written if getattr(x, "_dynamo_static_input_type", None) is None],
            "fed_back": [],  # inputs that an earlier call of a graph returned
        }  # fmt: skip
        graphs.append(graph)

        def run(*args):
            graph["fed_back"] += [name for name, x in zip(names, args, strict=True) if _address(x) in returned]
            out = gm.forward(*args)
            taken = {_address(x) for x in args}
            returned.update((_address(x), x) for x in out if _address(x) not in taken)  # (views of inputs are not)
            return out

        return run

    return graphs, backend


def _address(x) -> int | None:
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else None


def decode(model, cache, ids, mask, backend=None, new: int = NEW) -> list[list[int]]:
    config = None
    if backend is not None:
        config = CompileConfig(backend=backend, fullgraph=True)
        config._compile_all_devices = True  # generate() compiles on CUDA only, unless told
    out = model.generate(
        ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=new, min_new_tokens=new, do_sample=False,
        compile_config=config, disable_compile=backend is None, pad_token_id=0,
    )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def left_padded(batch: int = 2, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    ids = make_prompt(PROMPT, batch=batch)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0  # the second row is a shorter prompt, left-padded
    return ids.masked_fill(mask == 0, 0), mask


def capture(model, make_cache, padded: bool = True, new: int = NEW) -> tuple[list[dict], list, list]:
    """The eager decode's tokens, the compiled decode's and the graphs it compiled. (Without padding, the prompt's
    forward gets no mask from Transformers: SDPA's causal path.)"""
    torch._dynamo.reset()
    ids, mask = left_padded(padded=padded)
    eager = decode(model, make_cache(), ids, mask, new=new)
    graphs, backend = graph_recorder()
    compiled = decode(model, make_cache(), ids, mask, backend=backend, new=new)
    return graphs, eager, compiled


@pytest.fixture(scope="module")
def model():
    return get_model("llama")


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("spec", STATIC_SPECS)
def test_a_static_cache_compiles_one_capturable_decode_graph(model, spec, padded):
    cache_spec = parse_cache_spec(spec)
    graphs, eager, compiled = capture(model, lambda: cache_spec.build(model.config, max_length=PROMPT + NEW), padded)
    assert compiled == eager
    assert len(graphs) == 1, f"the decode step compiled {len(graphs)} times"
    (graph,) = graphs
    assert graph["int_inputs"] == []
    assert graph["written"], "the decode step writes the cache in place"
    assert graph["written_not_static"] == []
    assert graph["fed_back"] == [], "a decode step reads what an earlier step's graph returned"


@pytest.mark.parametrize("spec", ["quantized:k4v2:window=8:compile=on", "sink:2:6:bits=k3v2:compile=on"])
def test_a_rotated_cache_compiles_one_capturable_graph_through_the_twin_too(model, spec, monkeypatch):
    """On the CPU the rotated caches' attention is the C++ operator where it is built; where it is not (no
    compiler), the twin's compiled step (codes in plane order, a ring after them) meets the same conditions."""
    monkeypatch.setattr(rotated_cpu, "_LOADED", False)
    cache_spec = parse_cache_spec(spec)
    graphs, eager, compiled = capture(model, lambda: cache_spec.build(model.config, max_length=PROMPT + NEW))
    assert compiled == eager
    assert len(graphs) == 1, f"the decode step compiled {len(graphs)} times"
    assert graphs[0]["int_inputs"] == [] and graphs[0]["written_not_static"] == [] and graphs[0]["fed_back"] == []


AT_OR_UNDER_BUDGET = [
    "sink:2:19:compile=on",  # the prompt (21 tokens) is the budget
    "sink:2:19:bits=int4:group=8:compile=on",
    "h2o:21:compile=on",
    "sink:2:23:compile=on",  # under it: the slots fill during the decode, then evict
    "sink:2:23:bits=k3v2:compile=on",
    "h2o:24:recent=4:compile=on",
    "sink:2:40:compile=on",  # never full
]


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("spec", AT_OR_UNDER_BUDGET)
def test_an_evicting_cache_at_or_under_its_budget_compiles_one_capturable_graph(model, spec, padded):
    """A prompt not longer than the budget is not compacted: the cache holds `budget + 1` slots from it on all the
    same, the unused ones free, and the model's mask is as wide as the slots, so every decode step refills a freed
    slot and evicts one (a free one while there are any) with the same shapes, full or not (one graph, where the
    slots' filling compiled one per step); what a step leaves for the next (the sinks' copy, the freed slot, the
    rows' first positions) is in the cache's own buffers (the evicting caches once failed there on an H200)."""
    cache_spec = parse_cache_spec(spec)
    graphs, eager, compiled = capture(model, lambda: cache_spec.build(model.config, max_length=PROMPT + NEW), padded)
    assert compiled == eager
    assert len(graphs) == 1, f"the decode step compiled {len(graphs)} times"
    assert graphs[0]["int_inputs"] == [] and graphs[0]["written_not_static"] == [] and graphs[0]["fed_back"] == []


def test_static_cache_meets_the_same_conditions(model):
    graphs, eager, compiled = capture(
        model, lambda: StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
    )
    assert compiled == eager
    assert len(graphs) == 1
    assert graphs[0]["int_inputs"] == [] and graphs[0]["written_not_static"] == [] and graphs[0]["fed_back"] == []


def test_the_checks_catch_a_cache_that_grows(model):
    """A DenseCache that grows, told it may compile, counts in Python ints and writes buffers it replaces: dynamo
    compiles it again with the length as an int input, and its buffers are not marked static."""

    def growing():
        cache = DenseCache(config=model.config)
        for layer in cache.layers:
            layer.is_compileable = True  # what generate() asks before it compiles
        return cache

    new = 4  # (it compiles again at every step: three steps show it)
    with torch._dynamo.config.patch(recompile_limit=2 * new):
        graphs, eager, compiled = capture(model, growing, new=new)
    assert compiled == eager
    assert len(graphs) > 1
    assert any(graph["int_inputs"] for graph in graphs)
    assert any(graph["written_not_static"] for graph in graphs)


def test_the_checks_catch_a_cache_that_carries_graph_outputs(model):
    """Transformers' DynamicCache concatenates each step's keys into new tensors: under a compiled forward (called
    by hand, as generate() compiles no DynamicCache) the next step reads what the last one's graph returned, which a
    CUDA graph's next replay would have overwritten."""
    torch._dynamo.reset()
    graphs, backend = graph_recorder()
    forward = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    ids = make_prompt(PROMPT)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_kwargs(cache)).logits
        for step in range(3):
            token = logits[:, -1:].argmax(-1)
            logits = forward(input_ids=token, **cache_kwargs(cache), position_ids=torch.tensor([[PROMPT + step]])).logits
    assert graphs and any(graph["fed_back"] for graph in graphs)


@pytest.mark.parametrize("spec", STATIC_SPECS)
def test_the_tensors_stay_static_through_a_beam_reorder(model, spec):
    """A batch operation between steps (beam search reorders rows) may give a storage new tensors: they are marked
    static again, or the next compiled step would write inputs that CUDA graphs cannot capture."""
    cache = parse_cache_spec(spec).build(model.config, max_length=PROMPT + NEW)
    ids, mask = left_padded()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
    cache.reorder_cache(torch.tensor([1, 0]))
    for layer in cache.layers:
        tensors = layer.storage.tensors()
        assert tensors and all(getattr(t, "_dynamo_static_input_type", None) for t in tensors.values()), spec
        assert getattr(layer.storage.count.tensor, "_dynamo_static_input_type", None)
