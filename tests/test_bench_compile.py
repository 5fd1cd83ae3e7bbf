"""eval/bench_compile.py --paired: StaticCache timed beside each cache, and each ratio the median of its pairs'."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

EVAL = Path(__file__).resolve().parents[1] / "eval"


def test_paired_ratio_is_the_median_of_pair_ratios(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EVAL))
    import bench_compile

    # Per cache, the seconds its successive runs take (a warm-up first): StaticCache drifts 1 -> 3 -> 1 -> ...
    seconds = {"static": itertools.cycle([1.0, 1.0, 3.0]), "dense:compile=on": itertools.cycle([2.0, 2.0, 3.0])}
    calls = []

    def fake(model, spec, prompt, new, max_length, config):
        calls.append(spec.text)
        if spec.text not in calls[:-1]:  # a first call compiles: one graph, and dense's capture is skipped
            counters["stats"]["unique_graphs"] += 1
            counters["inductor"]["cudagraph_skips"] += spec.text == "dense:compile=on"
        return next(seconds[spec.text])

    monkeypatch.setattr(bench_compile, "decode_seconds", fake)
    threads = torch.get_num_threads()
    try:
        with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):  # main sets it
            bench_compile.main(["--out", str(tmp_path), "--paired", "--repeats", "2", "--contexts", "32", "--new", "2",
                               "4", "--backend", "eager", "--threads", str(threads), "--specs", "static",
                               "dense:compile=on"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)

    # Warm-ups, then the two alternately: static, dense, static, dense.
    assert calls == ["static", "dense:compile=on"] * 3
    rows = {r["cache"]: r for r in json.loads((tmp_path / "compile.json").read_text())["rows"]}
    # Pairs (1, 2) and (3, 3): ratios 2 and 1, median 1.5 (medians' ratio: 2.5 / 2 = 1.25).
    assert rows["dense:compile=on"]["vs_static"] == 1.5
    assert rows["static"]["vs_static"] == 1.0 and rows["static"]["decode_ms"] == 2000.0
    # What each cache's calls compiled, read off dynamo's and inductor's counters.
    assert (rows["static"]["graphs"], rows["static"]["cudagraph_skips"]) == (1, 0)
    assert (rows["dense:compile=on"]["graphs"], rows["dense:compile=on"]["cudagraph_skips"]) == (1, 1)
    assert "pairs with StaticCache" in (tmp_path / "compile.md").read_text()


def test_tiny_hd128_is_the_tiny_model_with_real_heads(monkeypatch):
    monkeypatch.syspath_prepend(str(EVAL))
    import bench_compile

    tiny, wide = (bench_compile.model_for(bench_compile.parse_args(["--out", "unused", "--model", model]))
                  for model in ("tiny", "tiny-hd128"))  # fmt: skip
    assert wide.config.num_hidden_layers == tiny.config.num_hidden_layers
    assert wide.config.vocab_size == tiny.config.vocab_size
    heads = lambda c: (c.hidden_size // c.num_attention_heads, c.num_attention_heads // c.num_key_value_heads)  # noqa: E731
    assert heads(tiny.config) == (32, 2) and heads(wide.config) == (128, 4)
    result = {"args": {"model": "tiny-hd128", "device": "cpu", "backend": "inductor", "mode": None, "threads": 1,
                       "new": [8, 72], "repeats": 1, "dry_run": False}, "machine": "m", "date": "d", "rows": []}  # fmt: skip
    assert "8 query heads on 2 KV heads of 128 channels" in bench_compile.markdown(result)


def test_a_cache_that_fails_is_reported_and_the_others_are_still_timed(tmp_path, monkeypatch):
    # A first run on a new device: one cache raising must not cost the run the others' figures, and the run still fails.
    monkeypatch.syspath_prepend(str(EVAL))
    import bench_compile

    def fake(model, spec, prompt, new, max_length, config):
        if spec.text.startswith("paged"):
            raise NameError("name 's85' is not defined")
        return {"static": 1.0, "dense:compile=on": 2.0}[spec.text]

    monkeypatch.setattr(bench_compile, "decode_seconds", fake)
    threads = torch.get_num_threads()
    try:
        with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit), pytest.raises(SystemExit) as ended:
            bench_compile.main(["--out", str(tmp_path), "--repeats", "1", "--contexts", "32", "48", "--new", "2", "4",
                                "--backend", "eager", "--threads", str(threads), "--specs", "static", "paged:compile=on",
                                "dense:compile=on"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert "2 cache(s) failed" in str(ended.value) and "NameError: name 's85' is not defined" in str(ended.value)
    result = json.loads((tmp_path / "compile.json").read_text())
    rows = {(r["context"], r["cache"]): r for r in result["rows"]}
    assert len(rows) == 6 and len(result["failed"]) == 2
    for context in (32, 48):
        assert rows[context, "dense:compile=on"]["vs_static"] == 2.0
        failed = rows[context, "paged:compile=on"]
        assert failed["compiled"] == "NameError: name 's85' is not defined" and math.isnan(failed["vs_static"])
    table = (tmp_path / "compile.md").read_text()
    # The table names the error's type; its message follows the table, once per failure
    assert table.count("failed: NameError") == 2 and table.count("paged:compile=on: NameError: name 's85'") == 2
    assert (tmp_path / "compile.png").exists()


def test_a_run_cut_inside_a_group_keeps_the_caches_timed_before(tmp_path, monkeypatch):
    # The device tool's limit kills a step mid-group (H2O at 32K x 8 once did); what was timed must be on disk.
    monkeypatch.syspath_prepend(str(EVAL))
    import bench_compile

    def fake(model, spec, prompt, new, max_length, config):
        if spec.text.startswith("h2o"):
            raise KeyboardInterrupt  # not an Exception: it ends the run, as a kill would
        return {"static": 1.0, "dense:compile=on": 3.0}[spec.text]

    monkeypatch.setattr(bench_compile, "decode_seconds", fake)
    threads = torch.get_num_threads()
    try:
        with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit), pytest.raises(KeyboardInterrupt):
            bench_compile.main(["--out", str(tmp_path), "--repeats", "1", "--contexts", "32", "--new", "2", "4",
                                "--backend", "eager", "--threads", str(threads), "--specs", "static", "dense:compile=on",
                                "h2o:16:compile=on"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    rows = {r["cache"]: r for r in json.loads((tmp_path / "compile.json").read_text())["rows"]}
    assert set(rows) == {"static", "dense:compile=on"} and rows["dense:compile=on"]["vs_static"] == 3.0
    assert "dense:compile=on" in (tmp_path / "compile.md").read_text()
