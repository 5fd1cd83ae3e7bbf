"""The exact-regions table (`lowbit_regions.py` prints it, `report.py` writes it into docs/benchmarks-lowbit.md): one
row per (config, first, boundary), one column per chunk size and text. Standard library only (`report.py` runs in CI
without torch)."""

from __future__ import annotations

import statistics


def regions_table(quantized: list[dict]) -> tuple[list[str], list[list]]:
    """(header, rows) of the runs `quantized` (perplexity runs of quantized configs): per cell the mean change over the
    seeds [min .. max] (seeds), and the mean seed-by-seed change from the same config without regions (a boundary row:
    from its first tokens alone). Bits per coordinate from the runs at the longest context."""
    panels = sorted(dict.fromkeys((r["chunk"], r["text"]) for r in quantized),
                    key=lambda p: (p[0], p[1] != "austen:prideprejudice", p[1]))  # the project's text first
    settings = sorted(dict.fromkeys((r["config"], r["first"], r["boundary"]) for r in quantized),
                      key=lambda s: ({"k4v2": 0, "k3v2": 1, "k2v2": 2}.get(s[0], 3), s[0], s[2], s[1]))  # fmt: skip
    by = {(r["config"], r["first"], r["boundary"], r["chunk"], r["text"], r["seed"]): r["delta_pct"] for r in quantized}
    longest = max(r["tokens"] for r in quantized)
    rows = []
    for config, first, boundary in settings:
        bits = [r["bits_per_coordinate"] for r in quantized
                if (r["config"], r["first"], r["boundary"]) == (config, first, boundary) and r["tokens"] == longest]
        cells = []
        for chunk, text in panels:
            seeds = sorted(s for (c, f, b, ch, t, s) in by if (c, f, b, ch, t) == (config, first, boundary, chunk, text))
            if not seeds:
                cells.append("")
                continue
            deltas = [by[(config, first, boundary, chunk, text, s)] for s in seeds]
            cell = f"{statistics.fmean(deltas):+.2f}%"
            if len(deltas) > 1:
                cell += f" [{min(deltas):+.2f} .. {max(deltas):+.2f}]"
            cell += f" ({len(deltas)})"
            ref, name = ((first, "0"), f"first {first} alone") if boundary != "0" else ((0, "0"), "none")
            plain = [(by[(config, *ref, chunk, text, s)], by[(config, first, boundary, chunk, text, s)]) for s in seeds
                     if (config, *ref, chunk, text, s) in by]  # fmt: skip
            if (first, boundary) != (0, "0") and plain:
                cell += f", {statistics.fmean(b - a for a, b in plain):+.2f} vs {name}"
            cells.append(cell)
        rows.append([config, first, boundary, f"{statistics.fmean(bits):.3f}", *cells])
    header = ["config", "first", "boundary", "bits/coord"] + [f"{t.removeprefix('austen:')} c{c}" for c, t in panels]
    return header, rows
