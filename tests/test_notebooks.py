"""Every notebook in notebooks/ runs top to bottom without error, and is committed executed (with its outputs and
figures, written by scripts/notebooks.sh) so that a reader browsing the repository sees them."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
#: Sizes the committed outputs stay under: PNG figures at a modest size, no huge printed tables.
MAX_PNG_BYTES = 150_000
MAX_NOTEBOOKS_BYTES = 1_500_000
RERUN = "rerun `bash scripts/notebooks.sh` and commit the notebooks"


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    # KVPLUS_NOTEBOOK_QUICK: the notebooks that read it run every step and check at smaller sizes (half the tokens:
    # quantized.ipynb 76 s at 1,024 tokens in CI); the committed outputs are of the full sizes. A copy in memory: the
    # committed file is not touched.
    monkeypatch.setenv("KVPLUS_NOTEBOOK_QUICK", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # The old cache keyword's warning (Transformers >= 5.24), which pyproject's filter cannot reach in a kernel
    warned = [o["text"] for cell in notebook.cells for o in cell.get("outputs", []) if "past_key_values" in o.get("text", "")]
    assert not warned


def _pngs(cell) -> list[str]:
    return [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]


def committed_problems(path: Path) -> list[str]:
    """What keeps the committed notebook at `path` from being one complete, small, top-to-bottom run."""
    code = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code" and cell.source.strip()]
    problems = []
    counts = [cell.execution_count for cell in code]
    if counts != list(range(1, len(code) + 1)):
        problems.append(f"execution counts {counts}, not 1..{len(code)} (one run, top to bottom)")
    for i, cell in enumerate(code):
        if "plt.show()" in cell.source and not _pngs(cell):
            problems.append(f"code cell {i} plots but has no PNG output")
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                problems.append(f"code cell {i} has an error output")
            if "past_key_values" in o.get("text", ""):
                problems.append(f"code cell {i} printed the old cache keyword's warning")
        # base64: 4 characters per 3 bytes
        big = [3 * len(png) // 4 for png in _pngs(cell) if 3 * len(png) // 4 > MAX_PNG_BYTES]
        if big:
            problems.append(f"code cell {i}: PNG of {big} bytes, over {MAX_PNG_BYTES}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_committed_with_outputs(path):
    problems = committed_problems(path)
    assert not problems, f"{path.name}: {problems}; {RERUN}"


def test_committed_notebooks_are_small():
    total = sum(path.stat().st_size for path in NOTEBOOKS)
    assert total < MAX_NOTEBOOKS_BYTES, f"notebooks/ holds {total} bytes; keep figures small and {RERUN}"


def test_committed_check_can_fail(tmp_path):
    """A notebook saved without outputs (or run out of order) fails the check."""
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("print(1)", execution_count=2),
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()", execution_count=1),
    ])
    nbformat.write(notebook, tmp_path / "bare.ipynb")
    problems = committed_problems(tmp_path / "bare.ipynb")
    assert any("execution counts" in p for p in problems) and any("no PNG" in p for p in problems), problems
