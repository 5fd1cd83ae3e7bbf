"""Accuracy against bytes at rest: merges `kvplus needle` runs (one folder per cache or group of caches, each with
its needle.json) into one table, JSON and plot, by mode.

    python eval/needle_bytes.py eval/results/needle_accuracy_bytes --out eval/results/needle_accuracy_bytes

Each run is `kvplus needle --lengths 2048 4096 --depths 0.1 0.3 0.5 0.7 0.9 --mode aware|agnostic --cache SPEC
[--keep SHARE] --out FOLDER/<name>`; this script reads every FOLDER/*/needle.json, groups the trials by mode and
writes `accuracy_bytes_<mode>.md`, `.json` and `.png` into --out. The x-axis is what each cache held after the answer
(payload and metadata, read off the cache object), per token seen, over float16 K/V's bytes for the same tokens.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_kvplus.evaluation.needle import NeedleResult, plot_accuracy_bytes
from hf_kvplus.evaluation.report import stamp


def table(result: NeedleResult) -> str:
    lengths = result.lengths
    head = ["cache", "family", *[f"x fp16 at {n}" for n in lengths], *[f"right at {n}" for n in lengths], "accuracy"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    rows = result.summary()
    rows.sort(key=lambda row: row["fp16_fraction"])
    for row in rows:
        cells = [f"`{row['cache']}`", row["family"], *[f"{row[f'frac_{n}']:.3f}" for n in lengths]]
        for n in lengths:
            mine = [t for t in result.trials if t.cache == row["cache"] and t.length == n]
            cells.append(f"{sum(t.correct for t in mine)}/{len(mine)}")
        cells.append(f"{row['accuracy']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = sorted(args.folder.glob("*/needle.json"))
    by_mode: dict[str, list[Path]] = {}
    for path in runs:
        by_mode.setdefault(json.loads(path.read_text()).get("mode", "aware"), []).append(path)
    args.out.mkdir(parents=True, exist_ok=True)
    for mode, paths in by_mode.items():
        result = NeedleResult.from_json(*paths)
        md = table(result)
        (args.out / f"accuracy_bytes_{mode}.md").write_text(md + "\n")
        result.to_json(args.out / f"accuracy_bytes_{mode}.json", {**stamp(), "mode": mode, "runs": [str(p) for p in paths]})
        plot_accuracy_bytes(result, args.out / f"accuracy_bytes_{mode}.png",
                            title=f"SmolLM2-135M pass key, {mode} mode: accuracy against bytes at rest")  # fmt: skip
        print(f"{mode} ({len(paths)} runs)\n{md}\n")


if __name__ == "__main__":
    main()
