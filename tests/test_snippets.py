"""README.md's and docs/*.md's Python blocks run as written, on the embedded model (scripts/snippets.py), or say in
a marker why they cannot. CI also runs the README's from the installed wheel (scripts/wheel_check.sh)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_snippets():
    spec = importlib.util.spec_from_file_location("snippets", ROOT / "scripts" / "snippets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_a_marker_states_a_reason_and_takes_one_form(tmp_path):
    snippets = load_snippets()
    page = tmp_path / "page.md"
    page.write_text("# A\n\n<!-- snippet: not run: a signature -->\n```python\nf(*, x)\n```\n\n```python\nx = 1\n```\n")
    marked, plain = snippets.extract(page)
    assert (marked.skip, marked.line, marked.code) == ("a signature", 4, "f(*, x)\n")
    assert (plain.skip, plain.line, plain.code) == (None, 8, "x = 1\n")
    for bad in ("<!-- snippet: skip -->", "<!-- snippet: not run: -->", "<!-- snippet: not run:  -->"):
        page.write_text(f"{bad}\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match=r"page\.md:1: a snippet marker is"):
            snippets.extract(page)
    page.write_text("<!-- an ordinary comment -->\n```python\nx = 1\n```\n")
    assert snippets.extract(page)[0].skip is None


def test_a_block_that_raises_is_named_and_ends_its_file(tmp_path, capsys):
    snippets = load_snippets()
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 2\n```\n\n```python\nassert x == 3, 'x is 2'\n```\n\n```python\nprint('after')\n```\n")
    (failure,) = snippets.run([page], tmp_path)
    assert failure.startswith("page.md:5: ") and "AssertionError: x is 2" in failure
    out = capsys.readouterr().out
    assert "page.md:1: ran" in out and "page.md:5: FAILED" in out and "page.md:9" not in out


def test_every_readme_and_docs_snippet_runs(tmp_path):
    """Run from outside the clone's root, as a reader's script would be; every block runs but the marked ones. Where
    the wheel check follows the suite in the same run (`scripts/test.sh` without arguments, as CI runs it: it sets
    KVPLUS_README_IN_WHEEL_CHECK=1), README.md's blocks are left to it, which runs them from the installed wheel
    without extras: the same blocks, not run twice (about 100 s of CPU on CI's 2 cores)."""
    snippets = load_snippets()
    files = snippets.default_files(ROOT)
    if os.environ.get("KVPLUS_README_IN_WHEEL_CHECK") == "1":
        files = [f for f in files if f.name != "README.md"]
    blocks = [block for f in files for block in snippets.extract(f)]
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "snippets.py"), *map(str, files)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ran, skipped = result.stdout.count(": ran in "), result.stdout.count(": not run (")
    assert ran == sum(not b.skip for b in blocks) > 0 and skipped == sum(bool(b.skip) for b in blocks), result.stdout
