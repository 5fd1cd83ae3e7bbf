"""The README's table quotes the result files: the demo's columns against eval/results/demo/demo.json, the GPU
columns against BENCHMARKS.md's tables, which eval/report.py writes from eval/results/ (and CI checks with --check).

A figure changed by hand in the README, or a result file rerun without updating the README, fails here.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The README's rows that the demo measured, as the demo names them (evicting caches at an eighth of 4K tokens).
DEMO = {"dense": "dense", "paged": "paged", "quantized:int4": "quantized:int4", "quantized:int2": "quantized:int2",
        "quantized:k4v2": "quantized:k4v2", "quantized:k3v2": "quantized:k3v2", "sink": "sink:4:508", "h2o": "h2o:512",
        "snapkv": "snapkv:512", "offloaded": "offloaded"}  # fmt: skip
#: The GPU run's names for the README's rows (evicting caches at a quarter of 16K tokens).
GPU = {"sink": "sink:4:4092", "h2o": "h2o:4096", "snapkv": "snapkv:4096"}


def markdown_table(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the first Markdown table whose header line starts with `header_start`, as cells."""
    start = text.index(header_start)
    lines = text[start:].split("\n\n")[0].splitlines()
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def readme_rows() -> dict[str, dict[str, str]]:
    header, _, *rows = markdown_table((ROOT / "README.md").read_text(), "| cache (spec) |")
    return {row[0].strip("`"): dict(zip(header, row, strict=True)) for row in rows}


def column(rows: dict, starts: str) -> str:
    (name,) = [h for h in next(iter(rows.values())) if h.startswith(starts)]
    return name


def test_the_demo_columns_are_the_committed_demo_run():
    rows = readme_rows()
    demo = {r["cache"]: r for r in json.loads((ROOT / "eval/results/demo/demo.json").read_text())["rows"]}
    ppl, needle, cpu = (column(rows, s) for s in ("perplexity change", "needle", "CPU decode"))
    for spec, name in DEMO.items():
        row, measured = rows[spec], demo[name]
        delta = "0" if measured["kind"] == "lossless" else f"{measured['ppl_delta_pct']:+.2f}%"
        assert row[ppl] == delta, spec
        assert row[needle] == ("yes" if measured["needle_right"] == 1 else "no"), spec
        speed = measured["decode_vs_baseline"], measured["decode_vs_baseline_min"], measured["decode_vs_baseline_max"]
        assert row[cpu] == "{:.2f} ({:.2f}..{:.2f})".format(*speed), spec
    base = demo["dynamic"]
    spread = f"DynamicCache's own rounds spread {base['decode_vs_baseline_min']:.2f}-{base['decode_vs_baseline_max']:.2f}x"
    assert spread in " ".join((ROOT / "README.md").read_text().split())


def test_the_gpu_columns_are_benchmarks_tables():
    rows = readme_rows()
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    header, _, *eager = markdown_table(benchmarks, "| cache | H100, B=1 |")
    eager = {r[0].strip("`"): dict(zip(header, r, strict=True)) for r in eager}
    header, _, *compiled = markdown_table(benchmarks, "| cache | H200, 4K, B=1 |")
    compiled = {r[0].strip("`"): dict(zip(header, r, strict=True)) for r in compiled}
    kv, speed, graph = (column(rows, s) for s in ("KV bytes", "GPU decode speed", "GPU compiled"))
    checked = 0
    for spec, row in rows.items():
        name = GPU.get(spec, spec)
        if re.match(r"\d", row[kv]):
            assert row[kv].split()[0] == eager[name]["KV x bf16"], spec
            checked += 1
        if re.match(r"\d", row[speed]):
            assert row[speed] == eager[name]["H100, B=8"], spec
            checked += 1
        if re.match(r"\d", row[graph]):
            assert row[graph] == compiled[name]["H200, 32K, B=1"], spec
            checked += 1
    assert checked >= 25


@pytest.mark.parametrize("spec", ["kvzip", "kvzap"])
def test_the_query_agnostic_needle_figures_are_the_committed_runs(spec):
    """Note (g): 6 of 10 pass keys at 20% of the context, agnostic, and the bytes held, from the merged runs."""
    runs = json.loads((ROOT / "eval/results/needle_accuracy_bytes/accuracy_bytes_agnostic.json").read_text())
    (row,) = [r for r in runs["summary"] if r["cache"].split(":")[:2] == [spec, "20%"]]
    trials = len(runs["lengths"]) * len(runs["depths"])
    right = round(row["accuracy"] * trials)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert readme_rows()[spec][column(readme_rows(), "needle")] == f"{right}/{trials} (g)"
    assert f"{right} of {trials} pass keys at {row['frac_4096']:.3f}x" in readme
