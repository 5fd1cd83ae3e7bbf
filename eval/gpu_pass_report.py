"""Merges the steps of `scripts/gpu_pass.sh` into one JSON and one Markdown file.

    python eval/gpu_pass_report.py gpu-pass --out gpu-pass
    python eval/gpu_pass_report.py call1/ call2/ call3/ --out merged/   # a pass run in several device calls

Each folder holds what some steps wrote (`steps.tsv`: step, exit status, seconds, limit; `<step>.json`
and `<step>.md`; the tests' JUnit XML). A step found in several folders is taken from the last.
Writes `gpu_pass.json` and `gpu_pass.md`; exits with status 1 if a step failed or timed out.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STEP_FILES = {  # step -> the result files it writes (json stems)
    "env": ["env"],
    "kernels": ["kernels"],
    "e2e-b1": ["e2e_b1"],
    "e2e-b8": ["e2e_b8"],
    "offload": ["offload"],
    "compile": ["compile"],
    "compile-b1": ["compile-b1/compile"],  # the shares of `compile`, each in a folder of its own
    "compile-b8": ["compile-b8/compile"],
}
TIMED_OUT = (124, 137)


def read_steps(folder: Path) -> dict[str, dict]:
    steps = {}
    path = folder / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit = line.split("\t")
            steps[name] = {"step": name, "rc": int(rc), "seconds": int(seconds), "limit": int(limit), "folder": str(folder)}
    return steps


def junit_summary(paths: list[Path]) -> dict:
    """Counts over JUnit files, and each failing or erroring test with the first line of its message."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for path in paths:
        root = ET.parse(path).getroot()
        for suite in root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        for case in root.iter("testcase"):
            for kind in ("failure", "error"):
                node = case.find(kind)
                if node is not None:
                    message = (node.get("message") or node.text or "").strip().splitlines()
                    failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                   "message": message[0][:300] if message else ""})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed, "files": [str(p) for p in paths]}


def merge(folders: list[Path]) -> tuple[dict, list[str]]:
    """The merged result and the Markdown sections of the steps, in pass order."""
    steps: dict[str, dict] = {}
    for folder in folders:
        steps.update(read_steps(folder))
    result: dict = {"steps": list(steps.values())}
    sections = []
    for name, info in steps.items():
        folder = Path(info["folder"])
        if name.startswith("tests"):  # tests, or a share of them (tests-syncs, tests-kernels)
            stems = ["tests", "tests_conformance"] if name == "tests" else [name]
            junits = [folder / f"{stem}.xml" for stem in stems if (folder / f"{stem}.xml").exists()]
            result[name] = junit_summary(junits) if junits else None
            sections.append(tests_markdown(result[name], name))
            continue
        if name == "aot":
            path = folder / "aot.json"
            result["aot"] = json.loads(path.read_text()) if path.exists() else None
            sections.append(aot_markdown(result["aot"]))
            continue
        for stem in STEP_FILES.get(name, []):
            json_path, md_path = folder / f"{stem}.json", folder / f"{stem}.md"
            if json_path.exists():
                result[stem] = json.loads(json_path.read_text())
            if md_path.exists():
                sections.append(md_path.read_text())
    return result, sections


def tests_markdown(summary: dict | None, step: str = "tests") -> str:
    title = "## Tests on CUDA" + ("" if step == "tests" else f" ({step})")
    if summary is None:
        return f"{title}\n\nno JUnit file was written\n"
    lines = [
        title,
        "",
        f"{summary['passed']} passed, {summary['failures']} failed, {summary['errors']} errors, "
        f"{summary['skipped']} skipped, of {summary['tests']}",
    ]
    if summary["failed"]:
        lines += ["", "| test | kind | message |", "| --- | --- | --- |"]
        lines += [f"| `{f['test']}` | {f['kind']} | {f['message'].replace('|', '/')} |" for f in summary["failed"][:60]]
        if len(summary["failed"]) > 60:
            lines.append(f"| ... {len(summary['failed']) - 60} more in the JSON | | |")
    return "\n".join(lines) + "\n"


def aot_markdown(report: dict | None) -> str:
    """Per kernel: specializations, outcomes, register range, rows that spill, the worst spill, shared memory."""
    if report is None:
        return "## Kernels compiled ahead of time\n\nno aot.json was written\n"
    lines = [
        "## Kernels compiled ahead of time",
        "",
        f"triton {report['triton']}, {', '.join(report['targets'])}{' (covering subset)' if report['quick'] else ''}, "
        f"{len(report['rows'])} specializations, {report['wall_seconds']} s wall",
        "",
        "| kernel | specializations | ok | newer arch | failed | registers | spilling | worst spill st/ld B | max shared B |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    by_kernel: dict[str, list[dict]] = {}
    for row in report["rows"]:
        by_kernel.setdefault(row["kernel"], []).append(row)
    for kernel, rows in by_kernel.items():
        ok = [r for r in rows if r["status"] == "ok"]
        regs = [r["registers"] for r in ok]
        spills = [r for r in ok if r["spill_stores"] or r["spill_loads"]]
        worst = max(spills, key=lambda r: r["spill_stores"] + r["spill_loads"], default=None)
        lines.append(
            f"| {kernel} | {len(rows)} | {len(ok)} | {sum(r['status'].startswith('needs') for r in rows)} | "
            f"{sum(r['status'] == 'error' for r in rows)} | {f'{min(regs)}-{max(regs)}' if regs else '-'} | "
            f"{len(spills)} | {_worst(worst)} | "
            f"{max((r['shared'] or 0 for r in ok), default=0)} |"
        )
    failed = [r for r in report["rows"] if r["status"] == "error"]
    lines += [f"\nFAILED {r['kernel']} [{r['spec']}] {r['target']}: {(r['error'] or '').splitlines()[0]}" for r in failed]
    return "\n".join(lines) + "\n"


def _worst(row: dict | None) -> str:
    return "-" if row is None else f"{row['spill_stores']}/{row['spill_loads']} [{row['spec']}]"


def status_markdown(steps: list[dict]) -> str:
    lines = ["| step | exit | seconds | limit | verdict |", "| --- | ---: | ---: | ---: | --- |"]
    for s in steps:
        verdict = "ok" if s["rc"] == 0 else ("timed out" if s["rc"] in TIMED_OUT else "FAILED")
        lines.append(f"| {s['step']} | {s['rc']} | {s['seconds']} | {s['limit']} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+", help="folders written by scripts/gpu_pass.sh")
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_pass.json and gpu_pass.md")
    args = parser.parse_args(argv)
    result, sections = merge(args.folders)
    env = result.get("env", {})
    # Without the env step, the device and date of the first step's stamp (`machine`: "vm: <device>, ...").
    stamped = next((part for part in result.values() if isinstance(part, dict) and "machine" in part), {})
    device = env.get("gpu", {}).get("name") or stamped.get("machine", "unknown device").removeprefix("vm: ").split(",")[0]
    title = f"# GPU pass: {device}, {env.get('date') or stamped.get('date', 'date unknown')}"
    md = "\n\n".join([title, status_markdown(result["steps"]), *sections])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_pass.json").write_text(json.dumps(result, indent=2, default=str))
    (args.out / "gpu_pass.md").write_text(md)
    print(md)
    if not result["steps"] or any(s["rc"] != 0 for s in result["steps"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
