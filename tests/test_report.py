"""eval/report.py writes BENCHMARKS.md from eval/results/ and `--check` catches a file that differs from it.

Reads JSON only: no model, no network, well under a second.
"""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_report():
    if str(ROOT / "eval") not in sys.path:  # (its helpers beside it, as when run as a script)
        sys.path.insert(0, str(ROOT / "eval"))
    spec = importlib.util.spec_from_file_location("eval_report", ROOT / "eval" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_benchmarks_md_is_what_the_report_writes():
    report = load_report()
    assert report.check(report.render(), (ROOT / "BENCHMARKS.md").read_text()) == []


def test_check_fails_on_one_changed_number_and_shows_it(tmp_path, capsys):
    report = load_report()
    text = report.render()
    line = "| `dense` | lossless | +0.000% | yes | 51,840 |"
    assert line in text
    changed = text.replace(line, line.replace("51,840", "51,841"))
    diff = report.check(text, changed)
    assert any(d.startswith("-") and "51,841" in d for d in diff)
    assert any(d.startswith("+") and "51,840" in d for d in diff)

    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text(changed)
    assert report.main(["--check", "--out", str(copy)]) == 1
    assert "51,841" in capsys.readouterr().out
    copy.write_text(text)
    assert report.main(["--check", "--out", str(copy)]) == 0


def test_the_figures_come_from_the_result_files(tmp_path, monkeypatch):
    """A number changed in a result JSON changes BENCHMARKS.md: the report reads it, it does not hold it."""
    report = load_report()
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    demo = json.loads((results / "demo" / "demo.json").read_text())
    demo["rows"][1]["bytes_per_token"] = 12345.0
    (results / "demo" / "demo.json").write_text(json.dumps(demo))
    monkeypatch.setattr(report, "RESULTS", results)
    assert "| `dense` | lossless | +0.000% | yes | 12,345 |" in report.render()
    assert report.check(report.render(), (ROOT / "BENCHMARKS.md").read_text())
