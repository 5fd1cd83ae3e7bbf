"""Plain-text tables and a stamp of where and how a result was produced."""

from __future__ import annotations

import datetime
import os
import platform
import sys


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """`columns` are (key, header, format spec); numbers right-aligned, text left-aligned."""
    cells = [[format(row.get(key, ""), spec) if row.get(key) is not None else "-" for key, _, spec in columns]
             for row in rows]
    headers = [header for _, header, _ in columns]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [bool(spec) for _, _, spec in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def stamp() -> dict:
    """Machine, date, versions and command line, written beside every result."""
    import torch
    import transformers

    from .. import __version__

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {device}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "versions": {"hf_kvplus": __version__, "python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "command": " ".join(sys.argv),
    }
