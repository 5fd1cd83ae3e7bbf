"""Runs the Python code blocks of README.md and docs/*.md as a reader would: each file's blocks in order, in one
namespace per file (a later block may use an earlier block's names, as in the README).

A block that cannot run says why in an HTML comment on the line above its fence, which the rendered page hides:

    <!-- snippet: not run: a signature, not a call -->

Any other `<!-- snippet: ... -->` comment, or one with no reason, is an error. The blocks run on the embedded model
(SmolLM2-135M-Instruct, converted once into the user cache folder by hf_kvplus.resolve): the working folder holds
`HuggingFaceTB/SmolLM2-135M-Instruct` as a link to it, so that `from_pretrained` of that hub id loads it with no hub
access. Usage: `python scripts/snippets.py [--root REPO] [FILE ...]`; exits 1 naming each block that raised.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BLOCK = re.compile(r"^(?:<!--(?P<comment>[^\n]*)-->\n)?```python\n(?P<code>.*?)^```", re.M | re.S)
MARKER = re.compile(r" snippet: not run: (?P<reason>\S.*?) ")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # of the fence
    code: str
    skip: str | None  # the stated reason it is not run


def extract(path: Path) -> list[Snippet]:
    """The ```python blocks of a Markdown file; a malformed marker raises ValueError naming its line."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code"))  # the fence's line, 1-based
        comment, skip = match.group("comment"), None
        if comment is not None and "snippet:" in comment:
            marker = MARKER.fullmatch(comment)
            if marker is None:
                raise ValueError(f"{path}:{line - 1}: a snippet marker is `<!-- snippet: not run: REASON -->`, "
                                 f"got `<!--{comment}-->`")
            skip = marker.group("reason")
        found.append(Snippet(path, line, match.group("code"), skip))
    return found


def default_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def model_link(folder: Path) -> None:
    """`folder/HuggingFaceTB/SmolLM2-135M-Instruct` -> the embedded model's converted copy."""
    from hf_kvplus.resolve.models import converted_model_dir

    link = folder / HUB_ID
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(converted_model_dir("smollm2-135m"), target_is_directory=True)


def run(files: list[Path], root: Path) -> list[str]:
    """Runs every block not marked; the failures, each as `path:line: error` with its output."""
    failures = []
    with tempfile.TemporaryDirectory(prefix="kvplus-snippets-") as work:
        model_link(Path(work))
        home = os.getcwd()
        os.chdir(work)
        try:
            for path in files:
                namespace: dict = {"__name__": "__snippet__"}
                for snippet in extract(path):
                    where = f"{path.relative_to(root) if path.is_relative_to(root) else path}:{snippet.line}"
                    if snippet.skip:
                        print(f"{where}: not run ({snippet.skip})")
                        continue
                    start, output = time.perf_counter(), io.StringIO()
                    try:
                        with contextlib.redirect_stdout(output):
                            exec(compile(snippet.code, where, "exec"), namespace)
                    except Exception:
                        failures.append(f"{where}: {traceback.format_exc(limit=-3)}{output.getvalue()[-2000:]}")
                        print(f"{where}: FAILED")
                        break  # later blocks of the file build on this one
                    print(f"{where}: ran in {time.perf_counter() - start:.1f} s")
        finally:
            os.chdir(home)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the checkout")
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default README.md and docs/*.md)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = [f.resolve() for f in args.files] or default_files(root)
    failures = run(files, root)
    for failure in failures:
        print(f"\n{failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
