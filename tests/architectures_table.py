"""Writes docs/architectures.md: every decoder architecture of the installed Transformers against every swept cache
family (`conformance.sweep`), with counts per cache.

    PYTHONPATH=tests python tests/architectures_table.py [docs/architectures.md]
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import transformers
from tqdm import tqdm

import hf_kvplus  # noqa: F401 - installs the attention route the caches attend through
from conformance.cases import CASES
from conformance.sweep import OUTCOMES, SWEEP_CASES, sweep
from conformance.zoo import MODEL_TYPES

SHORT = dict(zip(OUTCOMES, ("=", "~", "R", "FAILED"), strict=True))


def _reason(detail: str, model_type: str) -> str:
    """A refusal's message with what varies between models and caches taken out, to group them."""
    detail = re.sub(r"\b(SlotStore|PagedStorage|QuantizedStorage|StaticQuantizedStorage)\b", "<storage>", detail)
    detail = re.sub(r"of layers \[[0-9, ]+\]", "of its layers", detail)
    detail = re.sub(r"\([^()]*\)$", "", detail.replace(model_type, "<model>")).strip()
    return detail if len(detail) <= 170 else detail[:170].rsplit(" ", 1)[0] + " ..."


def main(out: str = "docs/architectures.md") -> None:
    rows = {}
    for model_type in tqdm(MODEL_TYPES, desc="architectures"):
        rows.update(sweep([model_type]))
    swept = {t: cells for t, cells in rows.items() if isinstance(cells, dict)}
    skipped = {t: reason for t, reason in rows.items() if isinstance(reason, str)}
    notes = {case.name: case.note for case in CASES}
    lines = [
        "# Architectures",
        "",
        f"Every causal-LM architecture of Transformers {transformers.__version__} "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(rows)} model types), as a tiny random model "
        "(`tests/conformance/zoo.py`), decoding a left-padded batch of 3 prompts greedily with DynamicCache and with "
        "each cache below (`tests/conformance/sweep.py`, asserted by `tests/test_architectures.py`; this page: "
        "`PYTHONPATH=tests python tests/architectures_table.py`).",
        "",
        "`=` DynamicCache's tokens and logits (lossless caches); `~` within the case's declared tolerance (lossy "
        "caches: the prompt's and first decode step's logits, scaled to the model's logit range); `R` refused at "
        "construction with a typed error (reasons below); `FAILED` anything else (there must be none).",
        "",
        "## Counts per cache",
        "",
        "| cache | what it is | served (= or ~) | refused | failed |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name in SWEEP_CASES:
        counts = Counter(cells[name].outcome for cells in swept.values())
        served = counts["identical"] + counts["within tolerance"]
        lines.append(f"| `{name}` | {notes[name]} | {served} | {counts['refused']} | {counts['FAILED']} |")
    lines += ["", f"{len(swept)} architectures swept, {len(skipped)} skipped (listed at the end).", ""]
    lines += ["## Every swept architecture", "", "| model type | " + " | ".join(f"`{n}`" for n in SWEEP_CASES) + " |"]
    lines.append("| --- |" + " :---: |" * len(SWEEP_CASES))
    reasons: dict[str, set[str]] = {}
    for model_type, cells in swept.items():
        lines.append(f"| {model_type} | " + " | ".join(SHORT[cells[n].outcome] for n in SWEEP_CASES) + " |")
        for name, c in cells.items():
            if c.outcome in ("refused", "FAILED"):
                reasons.setdefault(_reason(c.detail, model_type), set()).add(f"{model_type} ({name})")
    lines += ["", "## Refusals", "", "| reason | where |", "| --- | --- |"]
    for reason, where in sorted(reasons.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(sorted(where)[:8]) + (f" and {len(where) - 8} more" if len(where) > 8 else "")
        lines.append(f"| {reason.replace('|', '/')} | {shown} |")
    lines += ["", "## Skipped", "", "| model type | why |", "| --- | --- |"]
    lines += [f"| {t} | {reason.replace('|', '/')} |" for t, reason in skipped.items()]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(swept)} swept, {len(skipped)} skipped")


if __name__ == "__main__":
    main(*sys.argv[1:])
