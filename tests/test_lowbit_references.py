"""eval/lowbit_references.py --refresh: hf_kvplus's rows taken again from eval/lowbit_families.py's results, every
reference row kept, and refused where the families' DynamicCache run is not the merged one's."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import lowbit_references  # noqa: E402

TEXT = "austen:prideprejudice"


def merged(path: Path) -> Path:
    rows = [["tiny", "k4v3", None, 3.69, 0.28], ["ours", "k4v2", "after", 3.42, 2.68, 0.41],
            ["ours", "k4v3", None, 3.56, 3.63, 0.5], ["tq", "k4v2+mse", None, 3.06, 5.93]]
    path.write_text(json.dumps({"model": "gemma3-270m", "tokens": 4096, "chunk": 32, "window": 128,
                                "dynamic": {TEXT: {"perplexity": 31.42017, "seconds": 121}},
                                "series": {"tiny": "tiny-turboquant", "ours": "hf_kvplus", "tq": "turboquant-torch"},
                                "rows": {TEXT: rows}}))
    return path


def families(path: Path, dynamic: float) -> Path:
    where = {"model": "gemma3-270m", "text": TEXT, "tokens": 4096, "chunk": 32}
    runs = [where | {"spec": "dynamic", "perplexity": dynamic, "seed": None, "window": None},
            where | {"spec": "k4v2", "defaults": "after", "seed": 0, "window": 128, "bits": 3.421, "delta_pct": 1.477,
                     "se_pct": 0.4, "perplexity": 31.9},
            where | {"spec": "k4v2", "defaults": "after", "seed": 1, "window": 128, "bits": 3.421, "delta_pct": 2.5,
                     "se_pct": 0.4, "perplexity": 32.2},
            where | {"spec": "k3v2", "defaults": "calibrated", "seed": 0, "window": 128, "bits": 2.99,
                     "delta_pct": 1.2, "perplexity": 31.8}]
    path.write_text(json.dumps({"runs": runs}))
    return path


def test_refresh_replaces_our_family_rows_and_keeps_the_references(tmp_path):
    result = lowbit_references.refresh(merged(tmp_path / "merged.json"), families(tmp_path / "f.json", 31.42017))
    rows = result["rows"][TEXT]
    assert ["ours", "k4v2", "after", 3.421, 1.48, 0.4] in rows and ["ours", "k4v2", "after", 3.42, 2.68, 0.41] not in rows
    assert ["ours", "k3v2", "calibrated", 2.99, 1.2] in rows
    assert ["tiny", "k4v3", None, 3.69, 0.28] in rows and ["tq", "k4v2+mse", None, 3.06, 5.93] in rows
    assert ["ours", "k4v3", None, 3.56, 3.63, 0.5] in rows  # our own compare run, not a families row
    assert len(rows) == 5 and [row[3] for row in rows] == sorted((row[3] for row in rows), reverse=True)


def test_refresh_refuses_another_dynamic_cache_run(tmp_path):
    with pytest.raises(SystemExit, match="is not this run's"):
        lowbit_references.refresh(merged(tmp_path / "merged.json"), families(tmp_path / "f.json", 31.5))
