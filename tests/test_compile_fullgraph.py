"""Every cache's decode step compiles as one graph: `torch.compile(model.forward, fullgraph=True)`.

A graph break inside a cache (an untraceable builtin, a host read of a tensor value) makes
`fullgraph=True` raise, so each spec decodes greedily through steps that evict, flush a quantized group,
start a paged block or fetch an offloaded layer, on Llama (full attention) and Gemma 3 (sliding and full
layers, whose windows free paged blocks while decoding; slow-marked), and must produce the eager
decode's tokens. The backend is dynamo's "eager": what is tested is the capture, and it keeps the ops
(and so the logits) of the eager step, which makes token equality exact.

The caches keep their lengths in Python ints: dynamo specializes them at the first compile and makes
them dynamic at the second, but a paged step that starts a block (the block ids are Python ints) and a
quantized step that flushes a group compile anew. A hit of the recompile limit raises here instead of
falling back to eager, so every step of the test is a compiled one.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import cache_kwargs
from hf_kvplus.specs import parse_cache_spec

#: (The caches built with compile=on are compiled through `generate()` with `fullgraph=True`, and must compile one
#: graph: `test_compile_static_graph.py`; their refusal on sliding-window layers: `test_compile_generate.py`.)
SPECS = [
    "dense",
    "dense:max_tokens=64",
    "paged:block=8",
    "paged:block=8:max_tokens=64",
    "quantized:int4:group=8:window=8",
    "paged-quantized:int4:group=8:window=8:block=8",
    "sink:2:6",
    "sink:2:6:bits=int4:group=8",
    "h2o:8",
    "snapkv:8:observation=4",
    "offloaded",
    "offloaded-quantized:int4:group=8:window=8",
    "quantized:k3v2:window=8",
    "paged-quantized:k4v2:window=8:block=8",
    "h2o:8:bits=k4v2",
    "sink:2:6:bits=int4:group=8:first=0",  # sinks coded (the default keeps them exact)
    "h2o:8:recent=4:bits=int4:group=8:first=2:boundary=1",
]
PROMPT, STEPS = 13, 8  # 7 compiled steps, within the recompile limit of 8
#: Graphs a spec may compile over those steps: the first (lengths specialized), the second (lengths dynamic), and a
#: paged block's start or a quantized group's flush. More means a Python int of the cache specialized and the step
#: compiles anew as it changes (a sink cache's ring slot once did: a graph per step, 77 s of this test's tracing).
MAX_GRAPHS = 4


def greedy(model, cache, ids, forward) -> list[list[int]]:
    with torch.no_grad():
        token = model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        tokens = [token]
        for _ in range(STEPS - 1):
            token = forward(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            tokens.append(token)
    return torch.cat(tokens, dim=1).tolist()


@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("spec", SPECS)
def test_decode_step_compiles_as_one_graph(spec, arch):
    torch._dynamo.reset()
    model = get_model(arch)
    ids = make_prompt(PROMPT, batch=2)
    cache_spec = parse_cache_spec(spec)
    eager = greedy(model, cache_spec.build(model.config), ids, model)
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=STEPS):
        assert greedy(model, cache_spec.build(model.config), ids, compiled) == eager
    assert counters["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(counters["stats"])
