"""eval/lowbit_families.py's runs: a log started beside a published results.json extends its runs (a rerun that
measures new rows keeps the published ones in its table and results)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import lowbit_families  # noqa: E402

WHERE = {"model": "gemma3-270m", "text": "austen:prideprejudice", "tokens": 4096, "chunk": 32, "window": 128}


def run(spec: str, seed: int, delta: float) -> dict:
    return WHERE | {"spec": spec, "defaults": "same", "seed": seed, "delta_pct": delta, "bits": 4.0}


def test_the_log_extends_the_published_runs_without_repeating_them(tmp_path):
    published = [run("k4v2", 0, 0.5), run("int4", 0, 0.7)]
    (tmp_path / "results.json").write_text(json.dumps({"command": "c", "runs": published}))
    logged = [run("int4", 0, 0.7), run("k4v4", 0, 0.25), run("k4v4", 1, 0.3)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
    runs = lowbit_families.read_runs(tmp_path / "runs.jsonl")
    assert [(r["spec"], r["seed"]) for r in runs] == [("k4v2", 0), ("int4", 0), ("k4v4", 0), ("k4v4", 1)]


def test_either_alone_is_read_whole(tmp_path):
    (tmp_path / "runs.jsonl").write_text(json.dumps(run("k4v4", 0, 0.25)) + "\n")
    assert [r["spec"] for r in lowbit_families.read_runs(tmp_path / "runs.jsonl")] == ["k4v4"]
    (tmp_path / "runs.jsonl").unlink()
    (tmp_path / "results.json").write_text(json.dumps({"runs": [run("k4v2", 0, 0.5)]}))
    assert [r["spec"] for r in lowbit_families.read_runs(tmp_path / "runs.jsonl")] == ["k4v2"]
