"""Executes notebooks top to bottom and writes them back in place with their outputs (run by
scripts/notebooks.sh). Stops at the first cell that raises; the notebook is then left as it was."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    # No per-cell timestamps (record_timing): a rerun with the same results writes the same file.
    client = NotebookClient(notebook, timeout=900, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nbformat.write(notebook, path)


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        start = time.monotonic()
        execute(path)
        print(f"{path.name:24s} {time.monotonic() - start:6.1f} s  {path.stat().st_size / 1024:7.1f} KiB", flush=True)
    total = sum(p.stat().st_size for p in NOTEBOOKS.glob("*.ipynb"))
    print(f"notebooks/ together: {total / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
