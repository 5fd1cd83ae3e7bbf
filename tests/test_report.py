"""eval/report.py writes BENCHMARKS.md (and the pages it links) from eval/results/, and `--check` catches a page that
differs from it, a BENCHMARKS.md over its line limit and an eval/results over its size limit.

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


def test_every_page_is_what_the_report_writes():
    report = load_report()
    assert set(report.PAGES) >= {"BENCHMARKS.md", "docs/benchmarks-lowbit.md"}
    for page in report.PAGES:
        assert report.check(report.render(page), (ROOT / page).read_text(), page) == [], page


def test_benchmarks_md_and_eval_results_stay_within_their_limits():
    report = load_report()
    assert report.limits(report.render(), report.RESULTS) == []
    assert report.render().count("\n") <= 300


def test_the_limits_name_what_outgrew_them(tmp_path):
    report = load_report()
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "blob.bin").write_bytes(b"\0" * (report.MAX_RESULTS_BYTES + 1))
    problems = report.limits("line\n" * 301, tmp_path)
    assert len(problems) == 2
    assert "301 lines, over 300" in problems[0]
    assert "big 3.00 MiB" in problems[1]


def test_check_fails_on_one_changed_number_and_shows_it(tmp_path, capsys):
    report = load_report()
    text = report.render()
    line = "| `dense` | lossless | +0.000% | yes | 51,840 |"
    assert line in text
    changed = text.replace(line, line.replace("51,840", "51,841"))
    diff = report.check(text, changed)
    assert any(d.startswith("-") and "51,841" in d for d in diff)
    assert any(d.startswith("+") and "51,840" in d for d in diff)

    for page in report.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text(report.render(page))
    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text(changed)
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert "51,841" in capsys.readouterr().out
    copy.write_text(text)
    assert report.main(["--check", "--root", str(tmp_path)]) == 0


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
