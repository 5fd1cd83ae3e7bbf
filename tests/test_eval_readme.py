"""eval/README.md indexes eval/results/: every entry there has a row naming it as `results/<name>`, and every
`results/<name>` the README names exists, so the index cannot drift from the folder."""

import re
from pathlib import Path

EVAL = Path(__file__).resolve().parent.parent / "eval"
# `results/<name>` with <name> a whole folder or file name; `<...>` placeholders (e.g. `results/aot_sm90/<x>`) stop
# at the first path component, which is what must exist.
NAMED = re.compile(r"(?<![\w/])results/([A-Za-z0-9_.-]+)")


def _named() -> set[str]:
    return set(NAMED.findall((EVAL / "README.md").read_text()))


def _entries() -> set[str]:
    return {p.name for p in (EVAL / "results").iterdir() if not p.name.startswith(".")}


def test_every_result_entry_has_a_row() -> None:
    missing = sorted(_entries() - _named())
    assert not missing, f"eval/results/ entries not named as `results/<name>` in eval/README.md: {missing}"


def test_every_named_result_exists() -> None:
    stale = sorted(_named() - _entries())
    assert not stale, f"eval/README.md names results/ entries that do not exist: {stale}"
