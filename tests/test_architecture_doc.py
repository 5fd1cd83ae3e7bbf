"""docs/architecture.md checked against the code, so that the page cannot drift: the count of `is_compiling()`
calls it quotes, and its route table (what each cache's `update` returns and which kernel its decode reaches)."""

import re
from pathlib import Path

import pytest
import torch

import hf_kvplus.attention.route as route
import hf_kvplus.attention.slots as slots
import hf_kvplus.layer as layer
from conformance.models import build_model
from hf_kvplus import DenseCache, H2OCache, PagedCache, QuantizedCache, SinkCache, cache_kwargs

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "architecture.md").read_text()
KERNELS = ("decode_attention", "paged_decode_attention", "quantized_decode_attention", "slot_decode")

#: How the test builds the cache each row of the table names (the row's first cell, as written).
CACHES = {
    "`DenseCache`": [lambda config: DenseCache(config=config)],
    "`PagedCache`": [lambda config: PagedCache(config=config)],
    '`QuantizedCache(bits="k4v2")`': [lambda config: QuantizedCache(config, bits="k4v2", window=16)],
    "`SinkCache`, `H2OCache`": [
        lambda config: SinkCache(config, num_sinks=2, window=30),
        lambda config: H2OCache(config, budget=30),
    ],
}


def test_the_is_compiling_count_the_page_quotes_is_the_code_s():
    """What `scripts/architecture_counts.sh` counts: lines that call `is_compiling()` (not in backquotes)."""
    calls = re.compile(r"is_compiling\(\)($|[^`])")
    found = sum(
        1
        for path in [*ROOT.joinpath("hf_kvplus").rglob("*.py"), *ROOT.joinpath("kernels").rglob("*.py")]
        for line in path.read_text().splitlines()
        if calls.search(line)
    )
    quoted = re.search(r"`is_compiling\(\)` calls, (\d+)\)", PAGE)
    assert quoted, "docs/architecture.md no longer quotes the is_compiling() count"
    assert int(quoted.group(1)) == found


def _route_table() -> list[list[str]]:
    start = PAGE.index("| cache | `update` returns | route | kernel |")
    rows = []
    for line in PAGE[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_route_table_covers_the_caches_the_test_builds():
    assert [row[0] for row in _route_table()] == list(CACHES)


@pytest.mark.parametrize(
    ("row", "which"),
    [(row, which) for row in _route_table() for which in range(len(CACHES.get(row[0], [None])))],
    ids=lambda value: value[0].strip("`").replace("`", "") if isinstance(value, list) else str(value),
)
def test_each_row_of_the_route_table_is_what_a_decode_step_does(row, which, monkeypatch):
    cache_name, returns, _, kernel = row
    reads, kernels = [], []

    def spy_attend(original):
        def attend(read, module, query, *args, **kwargs):
            if query.shape[2] == 1:
                reads.append(type(read).__name__)
            return original(read, module, query, *args, **kwargs)

        return attend

    def spy_kernel(name, original):
        def call(*args, **kwargs):
            kernels.append(name)
            return original(*args, **kwargs)

        return call

    monkeypatch.setattr(layer, "attend", spy_attend(layer.attend))
    for module in (route, slots):
        for name in KERNELS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, spy_kernel(name, getattr(module, name)))
    model = build_model("llama")
    prompt = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = CACHES[cache_name][which](model.config)
    model.generate(prompt, max_new_tokens=3, do_sample=False, **cache_kwargs(cache))

    named_reads = set(re.findall(r"`(\w+Read)`", returns))
    assert reads and set(reads) <= named_reads, f"{cache_name}: decode read {set(reads)}, the page says {named_reads}"
    named_kernels = [name for name in re.findall(r"`(?:[\w.]+\.)?(\w+)`", kernel) if name in KERNELS]
    assert kernels and kernels[0] == named_kernels[0], f"{cache_name}: first kernel {kernels[:1]}, page {named_kernels}"
    assert set(kernels) <= set(named_kernels), f"{cache_name}: kernels {set(kernels)}, the page names {named_kernels}"
