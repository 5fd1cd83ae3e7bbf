"""Writes BENCHMARKS.md and the pages it links (`PAGES`) from the JSON in eval/results/<experiment>/.

    python eval/report.py            # rewrite BENCHMARKS.md and docs/benchmarks-*.md
    python eval/report.py --check    # exit 1 with a short diff when a page is not what this writes, or when
                                     # BENCHMARKS.md or eval/results outgrow their limits (CI)

One section per question (the demo, quality, retrieval, memory, CPU speed, GPU speed), the headline tables in
BENCHMARKS.md (at most `MAX_LINES` lines) and the detail on linked pages. Every figure is read from a
result file: each table names its command, machine, date and folder, and its baseline is the one the same run
measured (ratios are the ones the JSON holds, or computed against that baseline). An experiment that writes
results puts its latest run in eval/results/<experiment>/ and then reruns this script; what changed and why goes in
the commit message, not in BENCHMARKS.md. Reads JSON only (no torch, no model, no network): well under a second.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path

from regions_table import regions_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "eval" / "results"
TARGET = ROOT / "BENCHMARKS.md"
WIDTH = 120
#: BENCHMARKS.md stays a page of headline tables; the detail goes to a linked page (PAGES).
MAX_LINES = 300
#: eval/results holds the runs the pages quote, not every artefact of them (raw per-token files, plots nobody links):
#: the repository stays small to clone.
MAX_RESULTS_BYTES = 3 * 2**20


# --------------------------------------------------------------------------------------------------------------
# Reading and formatting


def load(rel: str) -> dict:
    path = RESULTS / rel
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        return json.load(f)


def jsonl(rel: str) -> list[dict]:
    """The records of a JSON-lines file in eval/results."""
    return [json.loads(line) for line in (RESULTS / rel).read_text().splitlines() if line.strip()]


def day(meta: dict) -> str:
    return meta["date"][:10]


def machine(meta: dict) -> str:
    """`NVIDIA H100 80GB HBM3`, or `2-core CPU, 1 thread` (the torch threads the run used)."""
    text = meta["machine"].removeprefix("vm: ")
    if text.startswith("NVIDIA"):
        return text.split(",")[0]
    cores, threads = re.search(r"(\d+) cores", text).group(1), re.search(r"torch threads (\d+)", text).group(1)
    return f"{cores}-core CPU, {threads} thread{'' if threads == '1' else 's'}"


def versions(meta: dict) -> str:
    v = meta["versions"]
    return ", ".join(f"{name} {v[name].split('+')[0]}" for name in ("torch", "triton", "transformers") if name in v)


def command(meta: dict) -> str:
    """The recorded command, without the venv's or a worktree's path in front of the program."""
    cmd = re.sub(r"^\S*/(kvplus|python3?)\b", r"\1", meta["command"])
    cmd = re.sub(r"^\S*/\w+_run\.py ", "kvplus ", cmd)  # kvplus run from a snapshot of the code at that commit
    cmd = re.sub(r"( --cache \S+)+", " --cache ...", cmd)  # the caches and specs are the table's rows
    cmd = re.sub(r" --specs( [^-]\S*)+", " --specs ...", cmd)
    cmd = re.sub(r" --(out|json) /tmp/\S+", "", cmd)  # written elsewhere, then copied to the folder named
    return f"python {cmd}" if cmd.startswith("eval/") else cmd


def where(meta: dict, folder: str, *, vers: bool = False) -> str:
    """`machine, date, versions; folder` for a run's provenance line."""
    parts = [machine(meta), day(meta)] + ([versions(meta)] if vers else [])
    named = f"eval/results/{folder.rstrip('/')}" in meta["command"]  # the command's --out already names it
    return ", ".join(parts) + ("" if named else f"; `eval/results/{folder}`")


def para(*parts: str) -> list[str]:
    text = " ".join(p.strip() for p in parts if p)
    return textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False) + [""]


def table(header: list[str], rows: list[list], align: str) -> list[str]:
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def pct(x: float | None, digits: int = 2) -> str:
    return "not measured" if x is None else f"{x:+.{digits}f}%"


def x2(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.2f}"


def right(acc: float, n: int) -> str:
    return f"{round(acc * n)}/{n}"


def mean_pct(values: list[float]) -> str:
    return f"{statistics.fmean(values):+.2f}%"


# --------------------------------------------------------------------------------------------------------------
# Sections


def header() -> list[str]:
    return ["# Benchmarks", "",
            "<!-- Written by `python eval/report.py` from eval/results/; CI checks it (`--check`): do not edit. -->",
            ] + para(
        "Current results, one section per question; each table names its command, machine, date and folder in",
        "`eval/results/` (`--cache ...`, `--specs ...`: the table's rows), and its baseline ran in the same run. CPU",
        "speeds come from a shared 2-core machine: read the ratios. Older runs:",
        "[docs/benchmarks-archive.md](docs/benchmarks-archive.md) and `git log`.",
    )  # fmt: skip


def demo() -> list[str]:
    d = load("demo/demo.json")
    rows = d["rows"]
    out = ["## The demo (CPU)", ""]
    out += para(
        f"`{command(d)}` (`bash scripts/demo.sh`); {where(d, 'demo/', vers=True)}.",
        f"{d['title'].replace('smollm2-135m', 'SmolLM2-135M (float32)')}. Against DynamicCache, the first row",
        "(\"x bytes\": bytes at rest over its float32, so 0.5 is fp16's size), whose own rounds spread",
        f"{rows[0]['decode_vs_baseline_min']:.2f}..{rows[0]['decode_vs_baseline_max']:.2f}x of their median over the run",
        f"and {d['timing']['baseline_spread']:.2f}x at most within one cache's rounds, which each ratio pairs with: the",
        f"machine's noise. Wall time {d['wall_s']:,.0f} s.",
    )
    body = [[f"`{r['cache']}`", r["kind"], f"{r['ppl_delta_pct']:+.3f}%",
             "yes" if r["needle_right"] == 1 else "no" if r["needle_right"] == 0 else f"{r['needle_right']:.0%}",
             f"{round(r['bytes_per_token']):,}", f"{r['bytes_vs_baseline']:.3f}", f"{r['decode_tok_s']:.1f}",
             f"{r['decode_vs_baseline']:.2f} ({r['decode_vs_baseline_min']:.2f}..{r['decode_vs_baseline_max']:.2f})",
             "yes" if r["same_tokens_as_baseline"] else "no"] for r in rows]  # fmt: skip
    out += table(["cache", "kind", "ppl change", "needle", "bytes/token", "x bytes", "decode tok/s",
                  "x speed, median (min..max)", "same tokens"], body, "llrcrrrrc")  # fmt: skip
    return out


def quality() -> list[str]:
    out = ["## Quality: perplexity", ""]
    # int4 on two texts (the same runs measured k4v2 and k3v2 without first tokens: the exact-regions table has them)
    runs = {t: load(f"window_semantics/after-{t}.json") for t in ("prideprejudice", "emma")}
    by = {t: {r["cache"]: r for r in d["rows"]} for t, d in runs.items()}
    pp = runs["prideprejudice"]
    out += para(
        f"**int4 (KIVI), 4K tokens** (`{command(pp)}`, and `--text austen:emma`; SmolLM2-135M, window 128;",
        f"{where(pp, 'window_semantics/')}): {pct(by['prideprejudice']['quantized:int4']['delta_pct'])} on",
        f"Pride and Prejudice (DynamicCache {by['prideprejudice']['dynamic']['perplexity']:.3f}),",
        f"{pct(by['emma']['quantized:int4']['delta_pct'])} on Emma ({by['emma']['dynamic']['perplexity']:.3f}).",
    )

    out += para(
        "**Low-bit formats in detail** ([docs/benchmarks-lowbit.md](docs/benchmarks-lowbit.md)): exact regions,",
        "calibrations, codebooks, the turning key centre; a second family:",
        *second_family(),
    )
    out += turboquant()

    d = load("ppl_smollm2_quant/ppl_summary.json")
    r = {row["cache"]: row for row in d["rows"]}
    ours = ", ".join(f"{c.split(':')[1]} {r[c]['delta_pct']:+.3f}%" for c in r if c.startswith("quantized:"))
    hf = ", ".join(f"{c.removeprefix('hf-quantized:')} {r[c]['delta_pct']:+.3f}%" for c in r if c.startswith("hf-"))
    out += para(
        f"**KIVI formats against Transformers' QuantizedCache, 8K tokens** (`{command(d)}`; {where(d, 'ppl_smollm2_quant/')}):",
        f"{ours}; Transformers' {hf} (DynamicCache {r['dynamic']['perplexity']:.4f}).",
    )

    d = load("evict_budgets_4k/evict_budgets.json")
    rows = [r for r in d["rows"] if r["method"] != "DynamicCache"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    budgets = list(dict.fromkeys((r["budget"], r["fraction"]) for r in rows))
    cell = {(r["method"], r["budget"]): r for r in rows}
    base = next(r for r in d["rows"] if r["method"] == "DynamicCache")
    out += para(
        f"**Evicting caches** (`{command(d)}`; {where(d, 'evict_budgets_4k/')}; {d['title']};",
        f"DynamicCache {base['perplexity']:.4f}):",
    )
    out += table(["budget"] + [f"{m} ({cell[(m, budgets[0][0])]['mode']})" for m in methods],
                 [[f"{b} tokens ({f:.0%})"] + [pct(cell[(m, b)]["increase_pct"]) for m in methods] for b, f in budgets],
                 "l" + "r" * len(methods))  # fmt: skip

    d = load("ppl_smollm2_streaming_20k/ppl_summary.json")
    parts = []
    for row in d["rows"]:
        stem = row["cache"].replace(":", "_")
        last = load(f"ppl_smollm2_streaming_20k/ppl_{stem}.json")["segments"][-1]
        parts.append(f"`{row['cache']}` {row['perplexity']:.2f} ({last['perplexity']:,.2f})")
    out += para(
        f"**20,000 tokens, past the trained 8,192** (`{command(d)}`; {where(d, 'ppl_smollm2_streaming_20k/')};",
        f"plotted by `notebooks/evicting.ipynb`): perplexity overall (in the last 2,000 tokens): {', '.join(parts)}.",
    )
    return out


def first_four(
    runs: list[dict], config: str, boundary: str, chunk: int, text: str = "austen:prideprejudice"
) -> list[dict]:
    """`eval/lowbit_regions.py`'s runs of `config` with 4 exact first tokens, `boundary` layers, at `chunk` on `text`."""
    return [r for r in runs if (r["config"], r["first"], r["boundary"], r["chunk"], r["text"]) ==
            (config, 4, boundary, chunk, text)]  # fmt: skip


def seed_zero_and_mean(runs: list[dict]) -> tuple[dict, float | None]:
    """Of one cache's runs at several rotation seeds: seed 0's (else the first), and the mean change where there are
    more than one."""
    zero = next((r for r in runs if r["seed"] == 0), runs[0])
    return zero, statistics.fmean(r["delta_pct"] for r in runs) if len(runs) > 1 else None


def second_family() -> list[str]:
    """One sentence for BENCHMARKS.md: Gemma 3's rotated presets before and after its key scale and layer formats,
    and calibrated, on both texts (seed 0, and the mean over the seeds run)."""
    d = load("lowbit_families_4k/results.json")
    runs = [r for r in d["runs"] if r["model"] == "gemma3-270m" and r["spec"] in ("k2v2", "k3v2", "k4v2")]

    def change(spec: str, kind: str, text: str) -> str:
        mine = [r for r in runs if (r["spec"], r["defaults"], r["text"]) == (spec, kind, text)]
        if not mine:
            return "-"
        zero, mean = seed_zero_and_mean(mine)
        return pct(zero["delta_pct"]) + (f" ({pct(mean)})" if mean is not None else "")

    texts = list(dict.fromkeys(r["text"] for r in runs))
    parts = []
    for spec in ("k2v2", "k3v2", "k4v2"):
        after = next(r for r in runs if (r["spec"], r["defaults"], r["seed"]) == (spec, "after", 0))
        cal = next((r for r in runs if (r["spec"], r["defaults"], r["seed"]) == (spec, "calibrated", 0)), None)
        text = (f"{spec} {' / '.join(change(spec, 'before', t) for t in texts)} → "
                f"{' / '.join(change(spec, 'after', t) for t in texts)} ({after['bits']:.2f} bits)")
        if cal:
            text += f", calibrated {' / '.join(change(spec, 'calibrated', t) for t in texts)} ({cal['bits']:.2f})"
        parts.append(text)
    return [f"Gemma 3 270M (`{command(d)}`; {day(d)}; 4,096 tokens of P&P / pattern.txt, chunks of 32, seed 0,",
            "in brackets the mean of seeds 0-2), one format and no key scale → as it ships (key scale, family formats,",
            "sinks on both kinds of layer): " + "; ".join(parts) + "."]


def gemma_calibrations() -> list[dict]:
    """Gemma 3's shipped k4v2 and k3v2 calibrations, as their files hold them."""
    from hf_kvplus.fitted import find
    from hf_kvplus.planning.configs import load_config

    config = load_config("gemma-3-270m")
    return [json.loads(find(config, f"calibration/{bits}", "calibration.json").read_text()) for bits in ("k4v2", "k3v2")]


def how_calibrated(calibrations: list[dict]) -> str:
    """How Gemma 3's shipped k4v2 and k3v2 calibrations (`gemma_calibrations`) were measured, their bits, and the full
    layers' rotations they chose."""
    names = []
    for c in calibrations:
        m, turned = c["measured"], c.get("layer_rotations") or {}
        seeds = m["rotation_seed"] if isinstance(m["rotation_seed"], list) else [m["rotation_seed"]]
        text = (f"{c['bits']} on {m['tokens']:,} tokens, rotation seed{'s' * (len(seeds) > 1)} "
                f"{', '.join(map(str, seeds))}: {c['bits_per_coordinate']:.3f} bits within {c['max_bits']}")
        if m.get("rotations", 1) > 1:
            chosen = ", ".join(f"layer {i} seed {turned[i]}" for i in sorted(turned, key=int)) or "each its own"
            text += f", each full layer's rotation the best of {m['rotations']} ({chosen})"
        names.append(text)
    text = calibrations[0]["measured"]["text"].removeprefix("austen:").capitalize()
    return (f"`kvplus calibrate` with the key scale and both kinds of sinks on {text}, the budget counted at "
            f"{calibrations[0]['measured']['budget_tokens']:,} tokens with the sinks: " + "; ".join(names)
            + "; [docs/artifacts.md](artifacts.md)")


def two_families() -> list[str]:
    """The rotated presets on Gemma 3 and SmolLM2, before and after Gemma 3's key scale and family layer formats (and
    its shipped calibrations), on two texts: seed 0, and the mean over the seeds run."""
    from hf_kvplus.precision import FAMILY_DEFAULTS

    d = load("lowbit_families_4k/results.json")
    runs = [r for r in d["runs"] if r["spec"] != "dynamic"]
    texts = list(dict.fromkeys(r["text"] for r in runs))
    name = {t: "P&P" if t.startswith("austen:") else Path(t).name for t in texts}
    by: dict[tuple, list[dict]] = {}
    for r in runs:
        by.setdefault((r["model"], r["text"], r["spec"], r["defaults"]), []).append(r)

    def cell(key) -> str | None:
        mine = by.get(key)
        if not mine:
            return None
        zero, mean = seed_zero_and_mean(mine)
        seeds = f", mean {pct(mean)} ({len(mine)} seeds)" if mean is not None else ""
        return f"{pct(zero['delta_pct'])} ({zero['bits']:.2f}){seeds}"

    def pair(model: str, text: str, spec: str) -> str:
        same, before, nosinks, first, after, cal_nosinks, cal = (cell((model, text, spec, kind)) for kind in (
            "same", "before", "nosinks", "firsttokens", "after", "calibrated-nosinks", "calibrated"))  # fmt: skip
        steps = [x for x in (before, nosinks, first, after) if x]
        shown = same or (" → ".join(steps) if steps else "not run")
        calibrated = " → ".join(x for x in (cal_nosinks, cal) if x)
        return shown + (f"; calibrated {calibrated}" if calibrated else "")

    specs = list(dict.fromkeys(r["spec"] for r in runs))
    body = [[f"`quantized:{spec}`"] + [pair(m, t, spec) for m in ("gemma3-270m", "smollm2-135m") for t in texts]
            for spec in specs]  # fmt: skip
    head = [f"{m} {name[t]}" for m in ("Gemma 3 270M", "SmolLM2-135M") for t in texts]
    (gemma,) = [f for f in FAMILY_DEFAULTS if "gemma3_text" in f.model_types]
    formats = "; ".join(f"{preset}: " + ", ".join(f"{kind} layers at {fmt}" for kind, fmt in kinds.items())
                        for preset, kinds in gemma.kind_bits.items())  # fmt: skip
    seeds = sorted({r["seed"] for r in runs})
    sinks = " / ".join(sorted({str(n) for n in gemma.sliding_sinks.values()}))
    full_sinks = " / ".join(sorted({str(n) for n in gemma.full_sinks.values()}))
    calibrations = gemma_calibrations()
    family_only = all(c["layer_bits"] == c["measured"]["family_layer_bits"] and not c.get("layer_rotations")
                      for c in calibrations)  # fmt: skip
    out = ["## Two model families", ""]
    out += para(
        f"**Gemma 3 270M against SmolLM2-135M** (`{command(d)}`; {machine(d)}, {day(d)}; {d['args']['tokens']} tokens in",
        f"chunks of {d['args']['chunk']}, a {d['args']['window']}-token window, seed 0 and where run the mean over",
        f"seeds {', '.join(map(str, seeds))}), perplexity change over DynamicCache (bits per coordinate), before → no",
        "sinks → first tokens → after: before, each preset's format on every layer and no key scale (what the presets",
        "were before the work on a second family); no sinks, Gemma 3's key scale ([docs/artifacts.md](artifacts.md))",
        f"and its family's layer formats (`precision.FAMILY_DEFAULTS`: {formats}), the full layers' first 4 tokens",
        f"exact; first tokens, those and each sliding layer's {sinks} sinks kept beside the codes (16-bit copies of the",
        "coded tokens with the shortest values, `sliding_sinks`); after, as it ships: each full layer keeps",
        f"{full_sinks} such copies in place of its first tokens (`full_sinks`). SmolLM2 takes none of them. The second",
        "text is Vim's pattern manual (Debian's vim-runtime), which neither model's artifacts were fitted on.",
        *([f"Calibrated: `calibration=\"auto\"`, the calibration shipped for the model ({how_calibrated(calibrations)})."]
          if any(r["defaults"] == "calibrated" for r in runs) or not family_only else [
          f"Gemma 3's shipped calibrations ({how_calibrated(calibrations)})",
          "hold the family's formats: with the sinks counted no layer's next format fits the budget, so",
          "`calibration=\"auto\"` builds these caches as they ship."]),
        *(["Further rows:", ", ".join(dict.fromkeys(f"`{command({'command': c})}`" for c in d.get("added_commands", [])))
           + "."] if d.get("added_commands") else []),
    )
    out += table(["spec"] + head, body, "l" + "r" * len(head))
    return out + para(
        "Why Gemma 3 loses more (`eval/lowbit_probes.py`; every measurement in",
        "`eval/results/lowbit_families_4k/diagnosis.md`): the three full-attention layers' keys, which QK-norm makes",
        "2-7x the length of their queries (about equal in SmolLM2), so a coded key moves a logit by about 2.0 there",
        "against 0.3-1.2 in SmolLM2, and the error grows with length as noisy logits take mass off the exact window:",
        "4-bit keys on the full layers alone cost +2.2% at 4K. The sliding layers' fixed key centre goes stale with",
        "position (about 0.16 points at 4K). Values, codebooks, head_dim 256's norm overhead and the window size are",
        "not the cause. Those keys waste most of their code on RoPE pairs the queries barely read: a key scale per",
        "layer and pair, the query's inverse (logits unchanged), cuts the full layers' logit error variance 6-26x",
        "(`eval/key_scaling.py`). Folded into the model's QK-norm, it takes k2v2 on every layer from +57.3% to",
        "+10.4% on P&P (pattern.txt +68.5% to +8.4%) and k4v2 as it ships from +2.68% to +1.37%; what it leaves is",
        "the full layers' 2-bit values (+1.5% at 4K) and the sliding layers (k4v2 there: +0.7%).",
    ) + para(
        "What was left on pattern.txt with the full layers' first tokens exact, before their sinks (`eval/lowbit_probes.py runs`, seed 0; the runs in",
        "`eval/results/lowbit_families_4k/key_scaling/sinks_formats_gemma3.jsonl`): k4v2 +0.79%, with its full",
        "layers exact +0.36%, its sliding layers exact +0.39%; the sliding layers with 8-bit values +0.41%, with 8-bit",
        "keys +0.94%: about half the loss is the full layers' codes and the other half the sliding layers' 2-bit",
        "values. The same bits spent otherwise did no better (full layers at k3v4 +1.54%, sliding layers at k3v3",
        "+0.82%; k3v2 with full layers at k4v2 +2.13%), nor do 8 sinks (+0.68% at 3.53 bits, over the budget). With",
        "the sinks, k2v2's sliding layers at k2v2 beat k3v1 on pattern.txt (seeds 0-2 +2.88 / +3.31 / +3.77% ->",
        "+2.53 / +2.87 / +3.13%) and about equal on P&P (+1.40 / +3.65 / +1.11% -> +1.89 / +3.35 / +1.09%): what",
        "k2v2 ships now.",
    ) + more_bits(by, texts, name)


def more_bits(by: dict, texts: list[str], name: dict) -> list[str]:
    """Gemma 3 at more bits than the presets, on the same protocol: where this format class's change falls as bits
    are added (8-bit KIVI: the protocol's floor; k4v4: half a bit over the k4v2 presets)."""
    model = "gemma3-270m"
    rows = {spec: [by.get((model, t, spec, "same"), []) for t in texts] for spec in ("int8", "k4v4")}
    if not all(all(runs) for runs in rows.values()):
        return []

    def changes(runs: list[dict]) -> str:
        zero, mean = seed_zero_and_mean(runs)
        return pct(zero["delta_pct"]) + (f" (mean {pct(mean)}, {len(runs)} seeds)" if mean is not None else "")

    def spread(runs: list[dict]) -> str:
        deltas = [r["delta_pct"] for r in runs]
        return f"{min(deltas):+.2f} to {max(deltas):+.2f}%"

    int8, k4v4 = rows["int8"], rows["k4v4"]
    calibrated = [by.get((model, t, "k4v2", "calibrated"), []) for t in texts]
    where = " / ".join(name[t] for t in texts)
    return para(
        f"**Gemma 3 270M at more bits**, the same protocol ({where}): KIVI int8 ({int8[0][0]['bits']:.2f} bits)",
        " / ".join(changes(r) for r in int8) + ", within a few hundredths of a point of DynamicCache (paired standard",
        f"error {int8[0][0]['se_pct']:.3f}): the chunked protocol itself adds nothing. k4v4 on every layer",
        f"({k4v4[0][0]['bits']:.2f} bits): " + " / ".join(changes(r) for r in k4v4) + (";" if all(calibrated) else "."),
        *([f"the k4v2 preset calibrated ({calibrated[0][0]['bits']:.2f} bits): " + " / ".join(changes(r) for r in
           calibrated) + "."] if all(calibrated) else []),
        f"The rotation's seed alone moves k4v4's change over {spread(k4v4[0])} on {name[texts[0]]}: on this model and",
        "4,096 tokens one seed's change is not a format's cost. k4v4 with neither the key scale nor the sinks costs",
        "more than the k4v2 preset as it ships at half a bit less: what costs most is the error of the tokens",
        "attention piles onto, not the bits of the rest (\"The rotation seed's spread\").",
    )


def seed_spread() -> list[str]:
    """Per rotation seed, a preset's perplexity change beside the coding error each kind of layer's attention output
    carries (`eval/seed_spread.py`): whether the seeds' spread is in the coding or in the metric, and where the error
    sits."""
    d = load("seed_spread_gemma3_k4v2/results.json")
    runs, kinds = d["seeds"], ("full", "sliding")
    names = ("keys_only", "values_only", "both", "value_error_top2pct_share", "value_error_shortest4_share")

    def mean(run: dict, kind: str, name: str) -> float:
        return statistics.fmean(r[name] for r in run["layers"] if r["kind"] == kind)

    body = [[run["seed"], f"{pct(run['delta_pct'])} ± {run['se_pct']:.2f}"]
            + [f"{mean(run, kind, n):.4f}" if n in names[:3] else f"{mean(run, kind, n):.2f}" for kind in kinds
               for n in names]
            for run in runs]  # fmt: skip
    deltas = [run["delta_pct"] for run in runs]
    spread = max(max(both) / min(both) for both in ([mean(run, kind, "both") for run in runs] for kind in kinds))
    full_top, slide_top = (statistics.fmean(mean(r, k, "value_error_top2pct_share") for r in runs) for k in kinds)
    slide_short = statistics.fmean(mean(r, "sliding", "value_error_shortest4_share") for r in runs)
    sinks = [x for x in runs[0]["layers"] if x["kind"] == "sliding" and x["layer"] >= 6]  # seed 0's layers 6-16
    late = [x["value_error_shortest4_share"] for x in sinks]
    sink_share = [x["worst_token_attention_share"] for x in sinks]
    sink_length = [x["worst_token_value_length_ratio"] for x in sinks]
    calibrated = ", its shipped calibration" if d.get("calibration") else ""
    out = ["## The rotation seed's spread", ""]
    out += para(
        f"**What the seed changes** (`{command(d)}`; {machine(d)}, {day(d)}): Gemma 3 270M, `quantized:{d['spec']}` as",
        f"it ships{calibrated}, {d['tokens']:,} tokens of P&P in chunks of {d['chunk']}, per rotation seed; beside each",
        "perplexity change (± its paired standard error over tokens), the relative squared error of the attention",
        "output of the model's own queries in one forward, with the keys coded alone, the values alone and both (mean",
        "over the layers of a kind), and the share of the value error held by the 2% of tokens carrying most of it and",
        f"by the 4 coded tokens with the shortest values. The perplexity change moves from {pct(min(deltas))} to",
        f"{pct(max(deltas))} with the seed while each kind of layer's output error stays within {spread:.2f}x across",
        "seeds: no rotation codes with less error than another on average; one realization of the same error moves a few",
        "thousand tokens' log-likelihoods differently, far beyond the per-token standard error (the errors of one coded",
        "token reach every later query), so a preset's expected cost is its mean over seeds, and lowering it takes",
        f"smaller errors where they weigh (below: which rotations), not a chosen seed. On the full layers the value error is spread out (the top 2% hold {full_top:.2f} of it);",
        f"on the sliding layers the top 2% hold {slide_top:.2f}, and the 4 coded tokens with the shortest values",
        f"{slide_short:.2f} on average ({min(late):.2f}-{max(late):.2f} on layers 6-16, seed 0): an attention sink inside",
        f"each sliding window, a token that takes up to {max(sink_share):.0%} of the last queries' attention with a",
        f"value {min(sink_length):.2f}-{max(sink_length):.2f} times as long as the median coded one (layers 6-16, seed 0),",
        "whose coded value's error weighs in squared. The sliding layers' sinks (\"Two model families\") keep such",
        "tokens as 16-bit copies beside their codes, about 0.05 bits per coordinate at 4K.",
    )
    head = ["seed", "perplexity change"] + [f"{kind}: {what}" for kind in kinds
                                            for what in ("keys", "values", "both", "top 2%", "4 shortest")]  # fmt: skip
    return out + table(head, body, "rr" + "r" * 10) + rotations_by_layer()


def rotations_by_layer() -> list[str]:
    """Which layers' rotations the seeds' spread comes from (k4v2, some layers rotated as another seed rotates them),
    and how much of it the full layers' sinks take away."""
    rel = "lowbit_families_4k/key_scaling/rotation_by_layer_gemma3.jsonl"
    got = {(r["text"], r["name"]): r["delta_pct"] for r in jsonl(rel)}
    texts = ("austen:prideprejudice", "pattern.txt")

    def both(name: str) -> str:
        return " / ".join(pct(got[t, name]) for t in texts)

    heavy_rel = "lowbit_families_4k/key_scaling/heavy_tokens_gemma3.jsonl"
    heavy = jsonl(heavy_rel)
    share = [r["top32_attention_share"] for r in heavy]
    common = [r["common_error_share"] for r in heavy]

    def low(x: list[float]) -> str:
        return f"{min(x):.0%}"

    def high(x: list[float]) -> str:
        return f"{max(x):.0%}"

    persuasion = "austen:persuasion"
    others = [got[persuasion, f"l5_seed{s}"] for s in range(6, 11)]
    swing = max(others) - got[persuasion, "seed0"]
    kept = got[persuasion, "full_sinks_l5_seed6"] - got[persuasion, "full_sinks_seed0"]
    return para(
        "**Which rotations** (`eval/lowbit_probes.py runs` with its `rotation_seeds`, some layers rotated as another",
        f"seed rotates them; the runs in `eval/results/{rel}`): k4v2 with the full layers' first tokens exact",
        "(`full_sinks=0`, as it shipped before their sinks), P&P / pattern.txt: seed 0",
        f"{both('seed0')}, seed 1 {both('seed1')}; seed 0 with the full layers (5, 11, 17) rotated as seed 1",
        f"{both('full_at_seed1')}, with layer 5 alone {both('l5_at_seed1')}, with the sliding layers",
        f"{both('sliding_at_seed1')}. On Persuasion, layer 5 at rotation seeds 6-10 in place of seed 0's:",
        ", ".join(pct(x) for x in others) + f" against {pct(got[persuasion, 'seed0'])}. One full layer's rotation moves",
        f"the change the same way on three texts, by up to {swing:.1f} points, while its average error does not",
        "change: it codes the few tokens the full layers' attention piles onto with an error that does not average out",
        f"(`eval/lowbit_probes.py heavy gemma3-270m austen:prideprejudice 2048`, `eval/results/{heavy_rel}`: in each",
        f"full layer the 32 coded tokens taking the most attention take {low(share)}-{high(share)} of it and are full",
        f"stops, quotes, newlines and names, and {low(common)}-{high(common)} of a frequent token's 2-bit value error is",
        f"common to all its occurrences, where independent errors would share {heavy[0]['independent_share']:.0%}).",
        "With 16 of them kept as copies (`full_sinks`, as it ships",
        f"now), layer 5's rotation seed 6 moves Persuasion by {kept:.2f} points ({pct(got[persuasion, 'full_sinks_seed0'])}",
        f"→ {pct(got[persuasion, 'full_sinks_l5_seed6'])}), against {got[persuasion, 'l5_seed6'] - got[persuasion, 'seed0']:.1f}",
        "before, and the 3-seed spread of k4v2 as it ships narrows (\"Two model families\").",
        "With them, seed 1 on Persuasion / pattern.txt:",
        f"{pct(got[persuasion, 'full_sinks_seed1'])} / {pct(got['pattern.txt', 'full_sinks_seed1'])}; with layer 5, 11 or",
        "17 rotated as seed 0 rotates it: "
        + ", ".join(" / ".join(pct(got[t, f"full_sinks_seed1_l{i}_as_seed0"]) for t in (persuasion, "pattern.txt"))
                    for i in (5, 11, 17))
        + ": each full layer's rotation moves both texts the same way, which a calibration on one text can choose",
        "(`kvplus calibrate --rotations`).",
    )


#: tiny-turboquant's presets (`TinyKVCache(compression=...)`)
TINY_PRESETS = {"safe": "K4V4", "balanced": "K4V3", "compact": "K3V3", "aggressive": "K3V2, values in groups of 32"}
#: a series' library and how it ran, in references_gemma3's rows
REFERENCE_NAMES = {"turboquant-torch MSE keys, coded once": ("turboquant-torch", " (MSE keys, coded once)"),
                   "turboquant-torch QJL keys, coded once": ("turboquant-torch", " (QJL keys, coded once)")}


def references_gemma3() -> list[str]:
    """hf_kvplus's presets on Gemma 3 270M against turboquant-torch's quantizers (each token coded once) and
    tiny-turboquant's cache at nearby bits, per text; for each preset as it ships, the best reference row at its bits
    or fewer and the cheapest reference row as good."""
    d = load("lowbit_references_gemma3/results.json")
    texts = d["texts"]
    d["rows"] = [dict(zip(d["columns"], row, strict=False)) | {"series": d["series"][row[0]], "text": text,
                 "bits": row[3]} for text, rows in d["rows"].items() for row in rows]  # fmt: skip
    label = {t: "P&P" if t.startswith("austen:") else Path(t).name for t in texts}

    def name(r: dict) -> str:
        config = r["config"] if r["series"] != "tiny-turboquant" else (
            f"`{r['config']}` ({TINY_PRESETS[r['config']]})" if r["config"] in TINY_PRESETS else r["config"].upper())
        how = {"after": " as it ships (Gemma 3's key scale, layer formats and sinks)",
               "firsttokens": " with Gemma 3's key scale, layer formats and sliding layers' sinks, full layers' first tokens",
               "nosinks": " with Gemma 3's key scale and layer formats, no sinks",
               "before": ", one format on every layer, no key scale",
               "calibrated": ", `calibration=\"auto\"`",
               "calibrated-nosinks": ", `calibration=\"auto\"`, no sinks"}.get(r.get("defaults"), "")  # fmt: skip
        library, ran = REFERENCE_NAMES.get(r["series"], (r["series"], ""))
        return f"{library} {config}{how or ran}"

    def change(r: dict) -> str:
        return pct(r["delta_pct"]) + (f" ± {r['se_pct']:.2f}" if "se_pct" in r else "")

    by_name: dict[str, dict[str, dict]] = {}
    for r in d["rows"]:
        by_name.setdefault(name(r), {})[r["text"]] = r
    body = [[n, f"{next(iter(got.values()))['bits']:.2f}"] + [change(got[t]) if t in got else "not run" for t in texts]
            for n, got in by_name.items()]  # fmt: skip
    out = ["## Against the references on Gemma 3", ""]
    out += para(
        f"**Gemma 3 270M, hf_kvplus against turboquant-torch and tiny-turboquant** ({machine(d)}, {day(d)};",
        f"`eval/results/lowbit_references_gemma3/` and its README; {d['tokens']} tokens of each text in chunks of",
        f"{d['chunk']}, a {d['window']}-token full-precision window, seed 0; DynamicCache perplexity",
        ", ".join(f"{label[t]} {d['dynamic'][t]['perplexity']:.3f}" for t in texts) + ").",
        "turboquant-torch: its quantizers (`TurboQuant`, MSE keys: every key bit to the Lloyd-Max codes) coding each",
        "token once after it leaves the window (`compare_turboquant.py`'s `+mse` rows); tiny-turboquant: its",
        "`TinyKVCache` with `key_bits`, `value_bits` (KIVI-style codes, quantized before attention); hf_kvplus:",
        "`QuantizedCache(bits=...)` as it ships (its key scale and family formats), with one format on every layer and",
        "no key scale, and with the shipped calibration, its rows from `lowbit_families_4k` (same ids, chunks and",
        "DynamicCache perplexity, taken again by `eval/lowbit_references.py --refresh`; its",
        "k4v3 row, without the key scale, by `compare_turboquant.py --ours-only`). Bits per coordinate as each script",
        "counts them (codes packed; norms, scales, zero points at float16; exact tokens at float32):",
    )
    out += table(["cache", "bits/coord"] + [f"{label[t]} change" for t in texts], body, "lr" + "r" * len(texts))
    verdicts = []
    for text in texts:
        rows = [r for r in d["rows"] if r["text"] == text]
        refs = [r for r in rows if r["series"] != "hf_kvplus"]
        for r in (r for r in rows if r.get("defaults") in ("after", "calibrated")):
            best = min((x for x in refs if x["bits"] <= r["bits"]), key=lambda x: x["delta_pct"], default=None)
            good = min((x for x in refs if x["delta_pct"] <= r["delta_pct"]), key=lambda x: x["bits"], default=None)
            verdicts.append([label[text], f"{r['config']}{', calibrated' if r['defaults'] == 'calibrated' else ''}",
                             f"{r['bits']:.2f}", pct(r["delta_pct"]),
                             "-" if best is None else f"{name(best)}: {best['bits']:.2f}, {pct(best['delta_pct'])}",
                             "ahead" if best is None or best["delta_pct"] > r["delta_pct"] else "behind",
                             "none" if good is None else f"{name(good)}: {good['bits']:.2f}, {pct(good['delta_pct'])}"])
    out += para("Ahead or behind, per preset as it ships (and calibrated, where run): the best reference row at its bits or fewer,",
                "and the cheapest reference row that does as well (one seed: ± above is hf_kvplus's paired standard",
                "error over the tokens, not recorded for the references):")
    out += table(["text", "hf_kvplus", "bits", "change", "best reference at its bits or fewer", "", "cheapest reference "
                  "as good"], verdicts, "llrrlll")  # fmt: skip

    def row(text: str, series: str, config: str, defaults: str | None) -> dict | None:
        return next((r for r in d["rows"] if (r["text"], r["series"], r["config"], r.get("defaults")) ==
                     (text, series, config, defaults)), None)  # fmt: skip

    def against(text: str) -> str:
        """tiny-turboquant's K4V3 against our k4v2 as it ships (and calibrated, where run), on one text."""
        tiny, ships, cal = (row(text, *key) for key in (("tiny-turboquant", "k4v3", None),
                            ("hf_kvplus", "k4v2", "after"), ("hf_kvplus", "k4v2", "calibrated")))  # fmt: skip
        def side(ours: dict) -> str:
            return "ahead of" if tiny["delta_pct"] < ours["delta_pct"] else "behind"

        text_ = (f"on {label[text]} {side(ships)} it as it ships ({pct(tiny['delta_pct'])} against "
                 f"{pct(ships['delta_pct'])}, {ships['bits']:.2f} bits)")
        if cal is not None:
            text_ += f" and {side(cal)} it calibrated ({pct(cal['delta_pct'])}, {cal['bits']:.2f} bits)"
        return text_

    return out + para(
        "Against turboquant-torch hf_kvplus is ahead at every bits measured, also with one format on every layer at",
        "the reference's bits; the reference's loss is in the keys (on P&P its k4v3 is about its k4v2 and its k3v3 far",
        "behind). Against tiny-turboquant each preset is ahead of every row at the preset's bits or fewer (its 2-bit",
        "per-token values lose most); at 3.5-3.7 bits its K4V3 (per-channel 4-bit keys, 3-bit values,",
        f"{row(texts[0], 'tiny-turboquant', 'k4v3', None)['bits']:.2f} bits) is, against our k4v2,",
        " and ".join(against(t) for t in texts) + ", and ahead of our k4v3 without the key scale (3.56 bits, P&P).",
    )


def exact_regions() -> list[str]:
    d = load("lowbit_regions_fixed_centre/lowbit_regions.json")
    runs = d["runs"]
    quantized = [r for r in runs if r["config"] != "dynamic"]
    bases = {(r["text"], r["chunk"]): r["perplexity"] for r in runs if r["config"] == "dynamic"}
    out = ["## Exact regions on two texts and three seeds", ""]
    out += para(
        "`python eval/lowbit_regions.py --out eval/results/lowbit_regions_fixed_centre --texts T --chunks C --configs ...",
        "--firsts ... --boundaries ... --seeds 0 1 2` per grid, then `--report-only`;",
        f"{where(d, 'lowbit_regions_fixed_centre/')}. {d['model']}, {d['tokens']} tokens, window {d['window']}; DynamicCache",
        ", ".join(f"{t.removeprefix('austen:')} {' / '.join(f'{p:.3f}' for (u, _), p in bases.items() if u == t)}"
                  for t in dict.fromkeys(t for t, _ in bases)) + " (c32 / c256: chunks of 32 / 256).",
        "Cells: mean change over seeds [min .. max] (seeds), and the mean seed-by-seed change from no regions (a",
        "calibrated row: from its first 4 tokens alone).",
    )
    # the calibration each class keeps in the table; the others (tried) are summed up below it
    kept = {"k4v2": "cal=k4v2_s3dp", "k3v2": "cal=k3v2_s3w", "k2v2": "cal=k2v2"}
    tried = [("k4v2", "cal=k4v2"), ("k4v2", "cal=k4v2_b4096"), ("k4v2", "cal=k4v2_dp"), ("k4v2", "cal=k4v2_s3"),
             ("k4v2", "cal=k4v2_s3d"), ("k4v2", "cal=k4v2_s3e"), ("k3v2", "cal=k3v2"), ("k3v2", "cal=k3v2_b4096"),
             ("k3v2", "cal=k3v2_dp"), ("k3v2", "cal=k3v2_dpup")]  # fmt: skip
    shown = [r for r in quantized if r["first"] in (0, 4) and r["boundary"] in ("0", kept.get(r["config"]))]
    first4 = {(r["config"], r["chunk"], r["text"], r["seed"]): r["delta_pct"] for r in quantized
              if (r["first"], r["boundary"]) == (4, "0")}  # fmt: skip
    layers = [r["delta_pct"] - first4[r["config"], r["chunk"], r["text"], r["seed"]] for r in quantized
              if r["first"] == 4 and r["boundary"] in ("1", "1@int8")]  # fmt: skip
    header, body = regions_table(shown)
    out += table(header, body, "lrlr" + "r" * (len(header) - 4))

    def of(config: str, boundary: str, chunk: int = 32) -> list[dict]:
        return first_four(quantized, config, boundary, chunk)

    def figure(config: str, boundary: str, seed0: bool = True) -> str:
        mine = of(config, boundary)
        if not mine:
            return "not measured"
        mean, bits = (statistics.fmean(r[k] for r in mine) for k in ("delta_pct", "bits_per_coordinate"))
        zero = next((r for r in mine if r["seed"] == 0), None) if seed0 else None
        error = f" ± {zero['se_pct']:.2f}" if zero and "se_pct" in zero else ""
        return f"{mean:+.2f}%" + (f" (s0 {zero['delta_pct']:+.2f}{error})" if zero else "") + f" at {bits:.3f}"

    targets = TARGETS_46
    errors = {c: [r["se_pct"] for r in of(c, kept[c]) if "se_pct" in r] for c in kept}
    out += para(
        "Kept: 4 exact first tokens by default in the k4v2, k3v2, k2v2 presets (`first=0`: off); not kept: 64 first",
        "tokens, boundary layers (first/last layer exact or int8:",
        f"{min(layers):+.2f} to {max(layers):+.2f} points; rows in the folder's `lowbit_regions.md`). `cal=X`: the",
        "layers `kvplus calibrate --text austen:persuasion --tokens 2048 --bits X --up ... --max-bits B` chose",
        "(`eval/results/calibrate_smollm2_rotated/`; by KL from full precision;",
        "`calibration=PATH`); `_b4096`: `--budget-tokens 4096`, exact knapsack; `_dpup`: and two-step `--up`",
        "(k3v2: k4v3); `_dp`: and `--up` k4v4 (k4v2) or k4v3 (k3v2), `--down` k3v2 (k4v2) or k2v2 (k3v2); `_s3`: and",
        "`--seed 0 1 2`; `_s3d`: and `--down k3v2`; `_s3dp`: and `--up k4v3 k4v4`; `_s3e`: and `--up k3v3 k3v4`;",
        "`_s3w`: `--up k3v3 k4v2 k4v3 k2v3 k3v4 --seed 0 1 2`. Not kept (P&P c32, 3-seed mean (s0: seed 0, ± its",
        "paired standard error over the 4,095 tokens, where measured) at bits/coord): "
        + "; ".join(f"{b.removeprefix('cal=')} {figure(c, b)}" for c, b in tried if of(c, b)) + ".",
        "With the fixed centre, preset / kept: "
        + "; ".join(f"{c} {figure(c, '0', False)} / {figure(c, kept[c])} (<= +{t}%, <= {b})" for c, (t, b) in targets.items())
        + ". One seed's change is noisy: its standard error is "
        + ", ".join(f"{statistics.fmean(e):.2f} ({c})" for c, e in errors.items() if e) + " points on the kept rows.",
        "These rows and calibrations were measured with the keys' fixed centre (`center=fixed` reproduces them); the",
        "caches now turn it with RoPE: the targets below, in \"turning key centre\".",
    )
    bench = load("bench_rotated_calibrated_cpu_4k/bench.json")
    base, *calibrated = bench["results"]
    out += para(
        f"**Decode of the kept calibrations** (`{command(bench)}`, {where(bench, 'bench_rotated_calibrated_cpu_4k/')}), tokens/s",
        "against plain `quantized:k4v2`'s in the same run: "
        + ", ".join(f"{r['cache'].split(':')[1]} {r['decode_tok_s'] / base['decode_tok_s']:.2f}x" for r in calibrated)
        + " (target: at least 1 / 1.1 = 0.91x).",
    )
    return out + value_codes() + turning_centre()


def value_codes() -> list[str]:
    """Other codes at the same bits, measured and not kept (`rotated_ablations.py value-codes`)."""
    d = load("rotated_ablations/value-codes.json")
    stats = {(r["side"], r["bits"]): r for r in d["rows"] if "side" in r}
    runs = [r for r in d["rows"] if "variant" in r]
    cells = []
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        zero = next(r["delta_pct"] for r in mine if r["seed"] == 0)
        cells.append(f"{variant} {statistics.fmean(r['delta_pct'] for r in mine):+.2f}% (s0 {zero:+.2f})")
    v2, k2 = stats["values", 2], stats["keys", 2]
    return para(
        "**Other codes at the same bits** (`python eval/rotated_ablations.py value-codes ... --out",
        f"eval/results/rotated_ablations`; {machine(d)}, {day(d)}): on Persuasion, a codebook fitted to the rotated",
        f"2-bit values lowers their MSE by {-v2['fitted_pct']:.1f}% (in-sample), scales per rotated coordinate change it",
        f"by {v2['scaled_pct']:+.1f}% (keys {k2['scaled_pct']:+.1f}%); a per-head mean leaves {v2['centred_energy']:.0%}",
        f"of the values' energy ({k2['centred_energy']:.0%} of the keys'). Calibrated k4v2, P&P c32: " + "; ".join(cells) + ".",
        "With KVQuant's key codes (`rotated_ablations.py centering --variants ...`, a simulated coder, c256, 3 seeds;",
        "`scaled_keys_*/`, `prerope_keys_*/`), against the centre alone: each key channel scaled to unit spread before",
        "the rotation, " + "; ".join(key_codes(c, "scaled_keys", "scaled-keys+center+sinks") for c in ("k4v2", "k3v2")),
        "(not kept); keys centred and coded before RoPE, "
        + "; ".join(key_codes(c, "prerope_keys", "pre-rope-keys+center+sinks") for c in ("k4v2", "k3v2"))
        + " (built as a centre that turns with RoPE instead, so the decode kernels still read keys after RoPE:",
        "\"turning key centre\" below).",
    )


#: The low-bit targets on P&P at chunks of 32: (perplexity change %, bits per coordinate) per class.
TARGETS_46 = {"k4v2": (0.25, 3.5), "k3v2": (0.6, 3.0), "k2v2": (3.0, 2.5)}
#: The calibration each class keeps with the turning centre (`eval/results/calibrate_smollm2_rotated/`), and each class's rows of
#: the turning-centre table (the preset, calibrations made with the fixed centre, the kept one).
KEPT_TURNING = {"k4v2": "cal=k4v2_t3dp", "k3v2": "cal=k3v2_s3w", "k2v2": "cal=k2v2_t"}
TURNING_ROWS = {"k4v2": ("0", "cal=k4v2_s3dp", "cal=k4v2_t3dp"), "k3v2": ("0", "cal=k3v2_s3w"),
                "k2v2": ("0", "cal=k2v2", "cal=k2v2_t")}  # fmt: skip

#: The turning-centre runs (`rotated_ablations.py centering`): (class, calibration, text, chunk) -> folder.
TURNING_RUNS = {
    ("k4v2", "k4v2_s3dp", "P&P", 32): "ropecenter_choice_c32_k4v2_s3dp",
    ("k4v2", "k4v2_s3dp", "Emma", 32): "ropecenter_choice_emma_c32_k4v2_s3dp",
    ("k3v2", "k3v2_s3w", "P&P", 32): "ropecenter_choice_c32_k3v2_s3w",
    ("k3v2", "k3v2_s3w", "Emma", 32): "ropecenter_choice_emma_c32_k3v2_s3w",
    ("k2v2", "k2v2", "P&P", 32): "ropecenter_choice_c32_k2v2",
}


def turning_centre() -> list[str]:
    """Keys coded relative to their pre-RoPE mean turned to each key's position, against the fixed centre
    the cache ships (both with its plain-code choice and first 4 tokens exact), on the kept calibrations."""
    rows, first = [], None
    for (config, cal, text, chunk), folder in TURNING_RUNS.items():
        d = load(f"rotated_ablations/{folder}/centering.json")
        first = first or d
        cells = []
        for variant in ("center+choice+sinks", "rope-center+choice+sinks"):
            mine = [r for r in d["rows"] if r["variant"] == variant]
            zero = next(r["delta_pct"] for r in mine if r["seed"] == 0)
            cells.append((statistics.fmean(r["delta_pct"] for r in mine), zero, statistics.fmean(r["kl_mnat"] for r in mine)))
        (fm, fz, fk), (tm, tz, tk) = cells
        rows.append([f"{config} (`{cal}`)", text, chunk, f"{fm:+.3f}% ({fz:+.2f})", f"{fk:.2f}",
                     f"{tm:+.3f}% ({tz:+.2f})", f"{tk:.2f}", f"{100 * (tk / fk - 1):+.0f}%"])  # fmt: skip
    header = ["class (calibration)", "text", "chunk", "fixed centre: mean (s0)", "KL", "turning centre: mean (s0)",
              "KL", "KL change"]  # fmt: skip
    return para(
        "**Turning key centre** (`python eval/rotated_ablations.py centering --configs X --calibration",
        "eval/results/calibrate_smollm2_rotated/CAL/calibration.json --variants center+choice+sinks rope-center+choice+sinks",
        f"--chunk 32 [--text austen:emma] --threads 1`; {machine(first)}, {day(first)};",
        "`eval/results/rotated_ablations/ropecenter_choice_*`): the keys coded relative to their pre-RoPE mean turned to",
        "each key's position (`kernels/turning_center.py`, the twins' coder), against the fixed centre the cache ships;",
        "both with the plain-code choice and the first 4 tokens exact, on the kept calibrations' layer formats, 3 seeds,",
        "4096 tokens, window 128. KL: from DynamicCache's next-token distributions, millinats per token (mean over",
        "seeds), far less noisy than the perplexity; the simulated coder's fixed rows come within a seed's noise of",
        "the cache's (k4v2 c32 +0.14% against +0.17%; its window holds exactly 128 tokens).",
    ) + table(header, rows, "llrrrrrr") + turning_cache()


def turning_cache() -> list[str]:
    """The caches as they ship (turning centre) against the fixed-centre rows, P&P, plain presets and kept
    calibrations, both chunk sizes; and the targets."""
    d, fixed = load("lowbit_regions_turning_centre/lowbit_regions.json"), load("lowbit_regions_fixed_centre/lowbit_regions.json")["runs"]

    def cell(runs: list[dict], seed0: bool = False) -> str:
        if not runs:
            return "not measured"
        deltas = [r["delta_pct"] for r in runs]
        text = f"{statistics.fmean(deltas):+.3f}% [{min(deltas):+.2f}..{max(deltas):+.2f}]"
        zero = next((r for r in runs if r["seed"] == 0), None)
        return text + (f" (s0 {zero['delta_pct']:+.2f} ± {zero['se_pct']:.2f})" if seed0 and zero else "")

    new, old = (load(f"calibrate_smollm2_rotated/{name}/calibration.json") for name in ("k4v2_t3dp", "k4v2_s3dp"))
    two = load("calibrate_smollm2_rotated/k2v2_t/calibration.json")
    changed = sum(old["layer_bits"].get(layer) != new["layer_bits"].get(layer)
                  for layer in set(old["layer_bits"]) | set(new["layer_bits"]))  # fmt: skip
    rows, met = [], []
    for config in TARGETS_46:
        for boundary in TURNING_ROWS[config]:
            mine = {c: first_four(d["runs"], config, boundary, c) for c in (32, 256)}
            theirs = {c: first_four(fixed, config, boundary, c) for c in (32, 256)}
            bits = statistics.fmean(r["bits_per_coordinate"] for r in mine[32]) if mine[32] else float("nan")
            gap = (statistics.fmean(r["delta_pct"] for r in mine[256]) - statistics.fmean(r["delta_pct"] for r in mine[32])
                   if mine[32] and mine[256] else None)  # fmt: skip
            rows.append([config, "preset (first 4)" if boundary == "0" else f"`{boundary.removeprefix('cal=')}`",
                         f"{bits:.3f}", cell(theirs[32]), cell(mine[32], True), cell(theirs[256]), cell(mine[256]),
                         "" if gap is None else f"{gap:+.2f}"])  # fmt: skip
            if boundary == KEPT_TURNING[config] and mine[32]:
                limit, most = TARGETS_46[config]
                mean = statistics.fmean(r["delta_pct"] for r in mine[32])
                zero = next(r["delta_pct"] for r in mine[32] if r["seed"] == 0)
                met.append(f"{config} mean {mean:+.2f}% {'met' if mean <= limit else 'missed'}, seed 0 {zero:+.2f}% "
                           f"{'met' if zero <= limit else 'missed'} (<= +{limit}% at <= {most} bits: {bits:.3f}); "
                           f"c256 within 0.15 points: {'met' if gap is not None and abs(gap) <= 0.15 else 'missed'}")  # fmt: skip
    header = ["class", "layers", "bits/coord", "c32 fixed centre", "c32 turning (shipped)", "c256 fixed",
              "c256 turning", "c256 - c32"]  # fmt: skip
    return para(
        "**The caches with the turning centre** (`python eval/lowbit_regions.py --out eval/results/lowbit_regions_turning_centre",
        "--texts austen:prideprejudice --chunks C --configs X --firsts 4 --boundaries 0 cal=NAME --seeds 0 1 2",
        f"--threads 1`; {machine(d)}, {day(d)}): P&P, 4096 tokens, window 128, first 4 tokens exact, 3 seeds (mean",
        "[min..max]; s0: seed 0 ± its paired standard error); the fixed-centre rows from `lowbit_regions_fixed_centre`.",
        "`k4v2_t3dp`: `k4v2_s3dp`'s options calibrated again with the turning centre (`kvplus calibrate ... --bits k4v2",
        "--up k4v3 k4v4 --down k3v2 --max-bits 3.5 --budget-tokens 4096 --seed 0 1 2`, three single-seed runs merged",
        f"by `--reuse`; {changed} of {new['num_layers']} layers chose otherwise; KL on Persuasion",
        f"{1000 * new['measured']['calibrated_kl']:.2f} mnat/token with the turning centre). `k2v2_t`: k2v2 calibrated",
        "with the turning centre (`kvplus calibrate ... --bits k2v2 --up k2v3 k3v2 k3v3 --max-bits 2.5 --budget-tokens",
        f"4096 --seed 0`: KL {1000 * two['measured']['base_kl']:.1f} -> {1000 * two['measured']['calibrated_kl']:.1f}",
        f"mnat/token at {two['bits_per_coordinate']:.3f} bits; `k2v2` was measured with the fixed centre, two",
        "candidates, no `--budget-tokens`).",
    ) + table(header, rows, "llrrrrrr") + para("Targets (P&P, chunks of 32; kept rows): " + "; ".join(met) + ".") + (
        turning_emma() + turning_bench())


def turning_bench() -> list[str]:
    """Decode speed with the turning centre against today's k4v2 (fixed centre), same run."""
    bench = load("bench_rotated_turning_cpu_4k/bench.json")
    base, *rest = bench["results"]
    return para(
        f"**Decode with the turning centre** (`{command(bench)}`, {where(bench, 'bench_rotated_turning_cpu_4k/')}), tokens/s",
        f"against `{base['cache']}`'s (the fixed centre) in the same run: "
        + ", ".join(f"`{r['cache'].split('calibration=')[0].rstrip(':')}`"
                    + (f" (`{r['cache'].split('calibrate_smollm2_rotated/')[1].split('/')[0]}`)" if "calibration=" in r["cache"] else "")
                    + f" {r['decode_tok_s'] / base['decode_tok_s']:.3f}x" for r in rest)
        + " (target: at least 1 / 1.1 = 0.909x). The centre's term is a dot product per key and query with its",
        "position's basis: about 60 us a layer at 4K in the C++ operator, which reads one block's basis and turns the",
        "query's weights per block (docs/kernels.md); it was 105 us reading a [D, positions] table, plus 12 us for the",
        "weights in Python, and 0.908x for plain k4v2 (`git log eval/results/bench_rotated_turning_cpu_4k`).",
    )


def turning_emma() -> list[str]:
    """The caches with the turning centre on the second text (Emma), presets and the kept calibrations, against the
    fixed-centre presets of `lowbit_regions_fixed_centre`."""
    d, fixed = (load(f"{folder}/lowbit_regions.json")["runs"] for folder in ("lowbit_regions_turning_centre", "lowbit_regions_fixed_centre"))

    def mean(runs: list[dict], config: str, boundary: str, chunk: int) -> str:
        got = [r["delta_pct"] for r in first_four(runs, config, boundary, chunk, "austen:emma")]
        return f"{statistics.fmean(got):+.2f}% [{min(got):+.2f}..{max(got):+.2f}]" if got else "not measured"

    rows = [[config, "preset (first 4)" if boundary == "0" else f"`{boundary.removeprefix('cal=')}`",
             *(mean(runs, config, boundary, c) for c in (32, 256) for runs in (fixed, d))]
            for config in TARGETS_46 for boundary in ("0", KEPT_TURNING[config])]  # fmt: skip
    header = ["class", "layers", "c32 fixed centre", "c32 turning", "c256 fixed centre", "c256 turning"]
    return para(
        "**On the second text** (Emma; the same command with `--texts austen:emma`, into `lowbit_regions_turning_centre`): 4096",
        "tokens, window 128, first 4 exact, 3 seeds, mean [min..max]. The calibrations were measured on Persuasion.",
    ) + table(header, rows, "llrrrr")


def key_codes(config: str, folder: str, variant: str) -> str:
    """`config`'s mean change (over seeds) with `variant`'s key codes against the centre alone (`centering.md`)."""
    rows = load(f"rotated_ablations/{folder}_{config}/centering.json")["rows"]
    base = [r for r in load("rotated_ablations/centering.json")["rows"] if (r["config"], r["variant"]) == (config, "center+sinks")]
    mean = statistics.fmean(r["delta_pct"] for r in rows if r["variant"] == variant)
    return f"{config} {mean:+.2f}% against {statistics.fmean(r['delta_pct'] for r in base):+.2f}%"


def turboquant() -> list[str]:
    """hf_kvplus's rotated formats as they ship against turboquant-torch (its cache; its quantizers coding each token
    once) and tiny-turboquant's presets: one row per pair, hf_kvplus at equal or fewer bits but k4v2's 4
    exact first tokens (+0.03)."""
    tq, tiny = load("compare_turboquant/turboquant.json"), load("compare_tiny_turboquant/tiny_turboquant.json")
    chunks = tq["chunks"]
    ours = {(r["config"], r["seed"], r["chunk"]): r for d in (tq, tiny) for r in d["runs"] if r["series"] == "hf_kvplus"}

    def stats(runs: list[dict], series: str, config: str) -> tuple[str, list[str]]:
        """Bits, and per chunk size the change (mean [min..max] over seeds where several)."""
        mine = [r for r in runs if (r["series"], r["config"]) == (series, config)]
        cells = []
        for chunk in chunks:
            deltas = [r["delta_pct"] for r in mine if r["chunk"] == chunk]
            big = deltas and not abs(deltas[0]) < 1000  # turboquant-torch's own cache, re-coding its past (or NaN)
            cells.append("" if not deltas else "NaN" if deltas[0] != deltas[0] else f"{deltas[0]:+,.0f}%" if big
                         else f"{deltas[0]:+.2f}%" if len(deltas) == 1
                         else f"{statistics.fmean(deltas):+.2f}% [{min(deltas):+.2f}..{max(deltas):+.2f}]")  # fmt: skip
        if not mine:
            return "-", ["not measured"] * len(chunks)
        return f"{statistics.fmean(r['bits_per_coordinate'] for r in mine):.2f}", cells

    series = ("turboquant-torch cache", "turboquant-torch QJL keys, coded once", "turboquant-torch MSE keys, coded once")
    pairs = [("k4v4", "safe", "tiny `safe` K4V4"), ("k4v3", "balanced", "tiny `balanced` K4V3"), ("k4v2", None, ""),
             ("k4v2", "k4v2", "tiny K4V2"), ("k3v2", None, ""), ("k3v2", "compact", "tiny `compact` K3V3"),
             ("k3v2", "aggressive", "tiny `aggressive` K3V2"), ("k2v2", None, "")]  # fmt: skip
    body, previous = [], None
    for config, theirs, name in pairs:
        bits, cells = stats(list(ours.values()), "hf_kvplus", config)
        row = [config, bits, *cells] if config != previous else ["", "", *[""] * len(chunks)]
        previous = config
        if theirs is None:  # turboquant-torch: its cache / QJL keys once / MSE keys once
            got = [stats(tq["runs"], s, config) for s in series]
            what = ": its cache (`compress_all()` per forward: re-codes the past) / coded once, QJL / MSE keys"
            row += [f"turboquant-torch {config}" + (what if config == "k4v2" else ", the same"),
                    " / ".join(b for b, _ in got)]  # fmt: skip
            row += [" / ".join(c[i] for _, c in got) for i in range(len(chunks))]
        else:
            bits, cells = stats(tiny["runs"], "tiny-turboquant", theirs)
            if theirs == "aggressive":  # and in brackets with its first and last layer at full precision
                pb, pc = stats(tiny["runs"], "tiny-turboquant", "aggressive+protect1")
                name, bits, cells = f"{name} (first, last layer exact)", f"{bits} ({pb})", [
                    f"{c} ({p})" for c, p in zip(cells, pc, strict=True)]  # fmt: skip
            row += [name, bits, *cells]
        body.append(row)
    out = para(
        f"**Against TurboQuant, tiny-turboquant** (`{command(tq)}`, and `compare_tiny_turboquant.py` into",
        f"`compare_tiny_turboquant`; {where(tq, 'compare_turboquant/')}; {tq['tokens']} tokens, window {tq['window']}; seeds 0-2",
        "where a range shows; hf_kvplus as it ships, its keys' centre turning with RoPE; bits count norms, scales,",
        "exact tokens; NaN: overflow):",
    )
    header = ["hf_kvplus", "bits"] + [f"c{c}" for c in chunks] + ["other", "bits"] + [f"c{c}" for c in chunks]
    return out + table(header, body, "lr" + "r" * len(chunks) + "lr" + "r" * len(chunks))


def retrieval() -> list[str]:
    out = ["## Retrieval", ""]
    d = load("needle_smollm2/needle.json")
    n = len(d["depths"])
    p = load("needle_prefill_smollm2/needle.json")
    acc = {r["cache"]: r["accuracy"] for r in p["summary"]}
    same = all(acc[c] == acc[c + ":compress=prefill"] for c in acc if "compress" not in c)
    out += para(
        f"**Pass key, SmolLM2-135M** (`{command(d)}`; {where(d, 'needle_smollm2/')}; {n} depths, one key per cell;",
        f"`compress=prefill` gives {'the same' if same else 'other'} answers: `eval/results/needle_prefill_smollm2`):",
    )
    body = [[r["cache"], right(r["accuracy"], n * len(d["lengths"]))] + [right(r[f"acc_{L}"], n) for L in d["lengths"]]
            + [f"{r['bytes_at_rest'] / 1e6:.1f} MB"] for r in d["summary"]]  # fmt: skip
    out += table(["cache", "right"] + [f"at {L}" for L in d["lengths"]] + [f"bytes at rest at {d['lengths'][-1]}"],
                 body, "l" + "r" * (len(d["lengths"]) + 2))  # fmt: skip

    d = load("ruler_smollm2_caches/needle.json")
    full = load("ruler_smollm2_full/needle.json")
    tasks = ", ".join(f"{t} {full['summary'][0][f'acc_{t}']:.0%}" for t in full["tasks"])
    out += para(
        f"**RULER-style tasks at {d['lengths'][0]} tokens, budgets of a quarter** (`{command(d)}`; {where(d, 'ruler_smollm2_caches/', vers=False)}),",
        "passkey / multikey: " + ", ".join(f"`{r['cache']}` {r['acc_passkey']:.0%} / {r['acc_multikey']:.0%}"
                                           for r in d["summary"]) + ".",
        f"The full cache on five tasks (`eval/results/ruler_smollm2_full`): {tasks}.",
    )

    g, gl = load("needle_gemma3/needle.json"), load("needle_gemma3_long/needle.json")
    cells = []
    for r, rl in zip(g["summary"], gl["summary"], strict=True):
        accs = [f"{r[f'acc_{L}']:.0%}" for L in g["lengths"]] + [f"{rl[f'acc_{L}']:.0%}" for L in gl["lengths"]]
        cells.append(f"`{r['cache']}` {' / '.join(accs)}")
    out += para(
        f"**Gemma 3 270M (32K positions)** (`{command(g)}`, and `--lengths 8192 16384` into `_long`; {day(g)}),",
        "at " + " / ".join(f"{L // 1024}K" for L in g["lengths"] + gl["lengths"]) + ": " + "; ".join(cells) + ".",
    )

    d = load("kvpress_smollm2/compare.json")
    rows = d["rows"]
    full = rows[0]
    modes, n = d["modes"], len(d["depths"])
    out += para(
        f"**Against NVIDIA kvpress at equal budgets** (`{command(d)}`; {where(d, 'kvpress_smollm2/')}; kvpress",
        f"{d['kvpress_versions']['kvpress']}, same ids: {d['context']} tokens of Emma, ppl of the next",
        f"{d['continuation']}, pass key at {n} depths {' / '.join(modes)}; full cache",
        f"{full['continuation_ppl']:.3f}, " + " / ".join(right(full[f"needle_{m}"], n) for m in modes) + "):",
    )
    ratios = sorted({r["ratio"] for r in rows[1:]})
    cell = {(r["method"], r["ratio"]): r for r in rows[1:]}
    body = [[m] + [v for ratio in ratios for v in [pct(cell[(m, ratio)]["ppl_delta_pct"])]
                   + [right(cell[(m, ratio)][f"needle_{mode}"], n) for mode in modes]]
            for m in dict.fromkeys(r["method"] for r in rows[1:])]  # fmt: skip
    head = [h for ratio in ratios for h in [f"ppl, {1 - ratio:.0%} kept"] + [f"{mode}, {1 - ratio:.0%}" for mode in modes]]
    out += table(["method"] + head, body, "l" + "r" * len(head))
    out += example_policies()
    return out + para(
        "**Needle accuracy against bytes** held, every family and composition on one axis, query-aware and agnostic:",
        "[docs/benchmarks-retrieval.md](docs/benchmarks-retrieval.md).",
    )


def example_policies() -> list[str]:
    """The policies written outside the package (examples/), each beside kvpress's press of the same name."""
    d = load("kvpress_example_policies/compare.json")
    modes, n = d["modes"], len(d["depths"])
    ours = {(r["method"].split()[1], r["ratio"]): r for r in d["rows"] if r["method"].startswith("hf_kvplus")}
    theirs = {(r["method"].split()[1].lower(), r["ratio"]): r for r in d["rows"] if r["method"].startswith("kvpress")}

    def cell(r: dict) -> str:
        return f"{pct(r['ppl_delta_pct'])} " + " ".join(right(r[f"needle_{m}"], n) for m in modes)

    return para(
        "**Policies written outside the package** (`examples/`: one file each, registered by importing it;",
        f"`{command(d)}`; {machine(d)}, {day(d)}; same protocol as above), ppl change and pass keys",
        f"({' / '.join(modes)}), ours against kvpress's:",
        "; ".join(f"`{name}` at {1 - ratio:.0%} kept {cell(r)} against {cell(theirs[(name, ratio)])}"
                  for (name, ratio), r in sorted(ours.items())) + ".",
    )


def short(spec: str) -> str:
    """A budgeted cache spec without its budget and file paths: `kvzap:820:weights=a/b` -> `kvzap`."""
    kind, _, *options = spec.split(":")
    return ":".join([kind] + [o for o in options if "/" not in o])


def needle_bytes() -> list[str]:
    aware, agnostic = load("needle_accuracy_bytes/accuracy_bytes_aware.json"), load("needle_accuracy_bytes/accuracy_bytes_agnostic.json")
    first = load(aware["runs"][0].removeprefix("eval/results/"))
    out = ["## Needle accuracy against bytes", ""]
    out += para(
        f"SmolLM2-135M (float32: the full cache is 2.0x float16), {len(aware['depths'])} depths per length; one folder",
        "per cache (its command in needle.json), merged by `python eval/needle_bytes.py",
        f"eval/results/needle_accuracy_bytes --out eval/results/needle_accuracy_bytes`; {machine(first)}, {day(first)}. \"x fp16\": bytes held",
        "after the answer per token seen, over float16 K/V's; `X%`: X% of each prompt. `--mode aware`: the whole prompt",
        "in one forward; `agnostic`: the context compressed, then the question appended:",
    )
    Ls = aware["lengths"]
    n = len(aware["depths"])
    full = next(r for r in aware["summary"] if r["family"] == "full precision")
    lost = [r for r in agnostic["summary"] if r["accuracy"] <= 0.1 and not r["cache"].startswith("kvzap:")]  # (one sentence)
    at = f"frac_{Ls[-1]}"

    def dominated(r):  # a composition another cache beats: as right, in fewer bytes (or righter in as few)
        return r["family"] in ("quantized", "evicting + quantized") and any(
            o is not r and o["accuracy"] >= r["accuracy"] and o[at] <= r[at] and (o["accuracy"], -o[at]) != (r["accuracy"], -r[at])
            for o in aware["summary"])  # fmt: skip

    hidden = [r for r in aware["summary"] if dominated(r)]
    rows = [("aware", r) for r in sorted(aware["summary"], key=lambda r: r["fp16_fraction"]) if r not in hidden]
    body = [[f"`{r['cache']}`", r["family"]] + [f"{r[f'frac_{L}']:.3f}" for L in Ls]
            + [right(r[f"acc_{L}"], n) for L in Ls] + [f"{r['accuracy']:.2f}"] for _, r in rows]  # fmt: skip
    head = [f"x fp16 at {L}" for L in Ls] + [f"right at {L}" for L in Ls] + ["accuracy"]
    out += table(["cache (aware)", "family"] + head, body, "ll" + "r" * len(head))
    kvzip = next(r for r in agnostic["summary"] if r["cache"].startswith("kvzip:"))
    timing = load("needle_accuracy_bytes/scoring_prefill/scoring_prefill.json")
    kvzap = next(r for r in agnostic["summary"] if r["cache"].startswith("kvzap:"))
    keeping = [r for r in aware["summary"] if r["accuracy"] >= full["accuracy"] and r is not full]
    evicting = max((r for r in keeping if r["family"] == "evicting"), key=lambda r: r["accuracy"], default=None)
    small = min(keeping, key=lambda r: r[f"frac_{Ls[-1]}"], default=None)
    total = n * len(Ls)
    out += para(
        f"Aware, `{evicting['cache']}` finds {right(evicting['accuracy'], total)} (the full cache {right(full['accuracy'], total)};"
        " SnapKV's window attends to \"The pass key is\", a max over 15 keeps the digits after it)." if evicting else "",
        f"The fewest bytes as right as the full cache: `{small['cache']}`, {small[at]:.3f}x." if small else "",
        f"Left out (a row above is as right in fewer bytes): {len(hidden)} caches, the best "
        + ", ".join(f"`{r['cache']}` {r['accuracy']:.2f} at {r[at]:.3f}x" for r in (
            max((h for h in hidden if h["family"] == f), key=lambda h: (h["accuracy"], -h[at]))
            for f in dict.fromkeys(h["family"] for h in hidden))) + "." if hidden else "",  # fmt: skip
        "Agnostic at 20%: " + ", ".join(f"`{r['cache'].split(':')[0]}` {right(r['accuracy'], total)}" for r in lost) + ";",
        f"`{kvzip['cache']}` {right(kvzip['accuracy'], total)} at {kvzip[at]:.3f}x; `kvzap:20%`",
        f"{right(kvzap['accuracy'], total)} at {kvzap[at]:.3f}x.",
        f"Prefill of {timing['tokens']} tokens, x DynamicCache: "
        + ", ".join(f"`{short(c)}` {r:.2f}x" for c, r in timing["ratio"].items() if "=" not in short(c)) + ".",  # (variants: in the folder)
    )
    return out


def memory() -> list[str]:
    out = ["## Memory", ""]
    d = load("plan_llama31_8b_32k.json")
    gib = d["memory_bytes"] / 1e9
    def one(plan: dict) -> str:
        group = f" (groups of {plan['group_size']})" if plan["group_size"] else ""
        return (f"{plan['kv_format']}{group} {plan['kv_bytes_per_token']:,.0f} ({plan['ratio_to_fp16']:.4g}x, "
                f"{plan['max_context']:,} tokens)")  # fmt: skip

    formats = "; ".join(one(plan) for plan in d["plans"])
    out += para(
        f"**KV formats, computed** (`{command(d)}`; {day(d)}): bytes per token at {d['plans'][0]['context']:,} tokens",
        "(scales, 128-token window), x fp16 without the window (as `tests/test_quantized_cache.py` asserts), and the",
        f"longest context beside the bf16 weights in {gib:g} GB: {formats}.",
    )

    s = load("bench_sink_cpu_8k/bench.json")
    r = {row["cache"]: row for row in s["results"]}
    out += para(
        f"**Evicting caches** hold their budget whatever the context: `sink:4:1020` {r['sink:4:1020']['bytes_at_rest'] / 1e6:.0f} MB",
        f"against DynamicCache's {r['dynamic']['bytes_at_rest'] / 1e6:.0f} MB at 8K tokens (SmolLM2-135M; `eval/results/bench_sink_cpu_8k`, {day(s)}).",
    )

    p = load("paged_cpu.json")
    res, a = p["results"], p["args"]
    beam = {x["cache"]: x for x in res["beam_search"]}
    samp = {x["cache"]: x for x in res["samples"]}
    pad = {x["cache"]: x for x in res["padded_batch"]}
    second = res["prefix_reuse"][1]
    out += para(
        f"**Paged** (`{command(p)}`; {where(p, 'paged_cpu.json')}; SmolLM2), x DynamicCache's bytes: {a['beams']}",
        f"beams over {a['prompt']} tokens {beam['PagedCache']['bytes_at_rest'] / beam['DynamicCache']['bytes_at_rest']:.2f}x (shared blocks),",
        f"{a['samples']} samples {samp['PagedCache']['bytes_at_rest'] / samp['DynamicCache']['bytes_at_rest']:.2f}x; a left-padded batch's payload",
        f"{pad['PagedCache']['payload_bytes'] / pad['DynamicCache']['payload_bytes']:.2f}x (its real tokens only); a second call sharing",
        f"{a['prefix']:,} prompt tokens: first token in {second['vs_first']:.3f}x the time ({second['reused_tokens']:,} reused).",
    )

    t = load("offload_tiers_4k/results.json")
    m = t["meta"]
    out += para(
        f"**Offloaded, MiB on device / host / disk after {m['tokens']} tokens** (`{command(m)}`; {where(m, 'offload_tiers_4k/')}; the",
        "host is the compute device here; in brackets the largest logit difference from DynamicCache):",
        "; ".join(f"{r['cache']} {r['device_mib']:.2f} / {r['host_mib']:.2f} / {r['disk_mib']:.2f}"
                  + (f" ({r['max_logit_diff']:.1e})" if r["cache"] != "DynamicCache" else "") for r in t["rows"]) + ".",
    )
    return out


def cpu_speed() -> list[str]:
    out = ["## CPU speed", ""]
    run = load("host_cpu_step/host.json")
    ratios = ", ".join(f"`{r['cache']}` {r['vs_dynamic']:.2f}" for r in run["rows"] if r["cache"] != "dynamic")
    out += para(
        f"**Host cost of one eager decode step**, x DynamicCache's (`{command(run)}`; {where(run, 'host_cpu_step/')};",
        "tiny 8-layer Llama, CPU time of the thread; target 1.25x; the table with the time outside the kernels:",
        f"[docs/benchmarks-cpu.md](docs/benchmarks-cpu.md)): {ratios}.",
    )
    out += para(
        "**Compiled decode on the CPU**, x StaticCache compiled the same way: [docs/benchmarks-cpu.md](docs/benchmarks-cpu.md).",
    )
    return out + eager_decode()


def compiled_cpu() -> list[str]:
    out = []
    sets = [("compile_cpu_paired_1k", "1K"), ("compile_cpu_8k", "8K"), ("compile_cpu_hd128", "1K, head dim 128")]
    data = [(load(f"{f}/compile.json"), label) for f, label in sets]
    cmds = "; ".join(f"{label}: `{command(d).removeprefix('python eval/bench_compile.py ')}`, {machine(d)}, {day(d)}"
                     for d, label in data)  # fmt: skip
    out += para(
        "**Compiled decode, x StaticCache compiled the same way** (`python eval/bench_compile.py`, tiny Llama,",
        f"alternating with StaticCache, median ratio; {cmds}):",
    )
    cell = {(r["cache"].replace(":compile=on", ""), label): r for d, label in data for r in d["rows"]}
    caches = [c for c in dict.fromkeys(c for c, _ in cell) if c != "static"]
    body = [["StaticCache, ms/token"] + [f"{cell[('static', label)]['decode_ms']:.2f}" for _, label in sets]]
    body += [[f"`{c}`"] + [x2(cell[(c, label)]["vs_static"]) if (c, label) in cell else "" for _, label in sets]
             for c in caches]  # fmt: skip
    return out + table(["cache"] + [label for _, label in sets], body, "l" + "r" * len(sets))


def eager_decode() -> list[str]:
    """The eager decode runs in a paragraph: the lowest lossy cache at 4K, int4 against Transformers' quanto cache and
    the paged cache at each length, the low-bit caches at 16K (every row: docs/benchmarks-cpu.md)."""
    runs = eager_decode_runs()
    cell = {(r["cache"], label): r["decode_vs_baseline"] for d, label in runs for r in d["rows"]}
    four = next(d for d, label in runs if label == "4K")
    lossy = sorted((r["decode_vs_baseline"], r["cache"]) for r in four["rows"]
                   if r["kind"] == "lossy" and not r["cache"].startswith("hf-"))  # (ours: not Transformers' caches)

    def at(cache: str) -> str:
        return ", ".join(f"{label} {cell[(cache, label)]:.2f}" for _, label in runs if (cache, label) in cell)

    long = ", ".join(f"`{c}` {cell[(c, '16K')]:.2f}" for c in dict.fromkeys(r["cache"] for r in runs[-1][0]["rows"])
                     if c not in ("dynamic", "quantized:int4", "hf-quantized:quanto:4"))  # fmt: skip
    return para(
        "**Eager decode, SmolLM2-135M, x DynamicCache's tokens/s**, higher is faster (`kvplus demo --threads 2",
        f"--context N --cache ...`, the demo's alternating rounds; {machine(four)}, {day(four)}; every cache with its",
        f"spread: [docs/benchmarks-cpu.md](docs/benchmarks-cpu.md)): at 4K every lossy hf_kvplus cache {lossy[0][0]:.2f}",
        f"(`{lossy[0][1]}`) to {lossy[-1][0]:.2f} (`{lossy[-1][1]}`); `quantized:int4` {at('quantized:int4')} against Transformers'",
        f"`hf-quantized:quanto:4` {at('hf-quantized:quanto:4')}; `paged` {at('paged')}; at 16K {long}.",
    )


def persistence() -> list[str]:
    out = ["## Saved caches and shared prefixes", ""]
    runs = [load(f"{name}/cache_load.json") for name in ("cache_load_cpu_4k", "cache_load_cpu_16k", "cache_load_gemma3_16k")]

    def filled(r: dict) -> str:
        return f"{r['disk_less_header_over_filled']:.3f}" if "disk_less_header_over_filled" in r else "-"

    body = [[d["title"].split(",")[0], f"{r['tokens'] // 1024}K", f"`{r['cache']}`", f"{r['prefill_seconds']:.1f}", f"{r['load_seconds']:.3f}",
             f"{r['prefill_over_load']:.0f}", f"{r['bytes_at_rest'] / 2**20:.1f}", f"{r['bytes_on_disk'] / 2**20:.1f}",
             f"{r['disk_less_header_over_rest']:.3f}", filled(r), "yes" if r["same_next_logits"] else "no"]
            for d in runs for r in d["rows"]]  # fmt: skip
    out += para(
        "**`load_cache` against the prefill it replaces**, each row's prefill and load in the same run",
        "(" + "; ".join(f"`{command(d)}`, {day(d)}" for d in runs) + f"; {machine(runs[0])}; KVzip's prefill includes",
        "its compression; headroom, a buffer's room to grow, is left out of a dense cache's file and saved with a",
        "quantized or evicting one; a turning key centre's per-position tables (k4v2), one per cache, are derived from",
        "the model and rebuilt on load: neither saved nor counted at rest. KVzip's reconstruction needs positions past",
        "SmolLM2-135M's 8,192 at 16K, so Gemma 3 270M (32K) carries KVzip there; its run was niced beside other work):",
    )
    out += table(["model", "tokens", "cache", "prefill s", "load s", "prefill / load", "MiB at rest", "MiB on disk",
                  "(disk - header) / rest", "/ (rest - headroom)", "same logits after load"], body, "lllrrrrrrrc")  # fmt: skip
    f = load("prefix_folder_cpu_2k/prefix_folder.json")
    rows = f["rows"]
    return out + para(
        f"**Processes sharing one document through a prefix folder** (`{command(f)}`; {machine(f)}, {day(f)}): each",
        "process's run through the shared folder, then at once its run alone; first-token time shared against alone:",
        "; ".join(f"process {r['process']} reused {r['reused_tokens']:,} of {r['prompt_tokens']:,} tokens, "
                  f"{r['ttft_shared_seconds']:.2f} s against {r['ttft_alone_seconds']:.2f} s "
                  f"({r['alone_over_shared']:.1f}x)" for r in rows) + ".",
    )


def gpu_speed() -> list[str]:
    out = ["## GPU speed", ""]
    env, h200 = load("gpu_h100/call1/env.json"), load("gpu_h200_pass/env.json.gz")

    def ceilings(e: dict) -> str:
        bw = e["bandwidth"]
        return f"copy {bw['copy_gb_per_s']:.0f} GB/s, pinned host-to-device {bw['pinned']['gb_per_s']:.1f} GB/s"

    out += para(
        f"Llama-3.1-8B shapes, random bf16, on an {env['gpu']['name']} ({day(env)}; {versions(env)}, CUDA",
        f"{env['gpu']['cuda']}; {ceilings(env)}): `bash scripts/gpu_pass.sh env:30 kernels:130 e2e-b1:110 e2e-b8:150",
        "offload:110`, then `compile-b8:255`, into `eval/results/gpu_h100/call1`, `call2`; and on an",
        f"{h200['gpu']['name']} ({day(h200)}, the same versions; {ceilings(h200)}): `bash scripts/gpu_pass.sh env:20",
        "e2e-b1:130 offload:140 tests-syncs:75`, then `e2e-b8:235 compile-b8:235`, and `python eval/peak_phases_gpu.py",
        "--out gpu-pass`, into `eval/results/gpu_h200_pass` (the code of commit 2cdb6ab); the kernels' table from an",
        "earlier H200 pass the same day, `eval/results/gpu_h200_eager`.",
    )
    # Compiled decode under CUDA graphs
    runs = [("H200", load("gpu_h200_compile/compile-b1/compile.json")),
            ("H200", load("gpu_h200_pass/compile-b8/compile.json.gz")),
            ("H100", load("gpu_h100/call2/compile.json"))]  # fmt: skip
    cols = [(dev, r["context"], r["batch"]) for dev, d in runs for r in d["rows"] if r["cache"] == "static"]
    cell = {(dev, r["context"], r["batch"], r["cache"]): r for dev, d in runs for r in d["rows"]}
    caches = list(dict.fromkeys(r["cache"] for _, d in runs for r in d["rows"]))
    body = [["StaticCache, ms/token"] + [f"{cell[(*c, 'static')]['decode_ms']:.2f}" for c in cols]]
    for cache in caches[1:]:
        body.append([f"`{cache.replace(':compile=on', '')}`"]
                    + [x2(cell[(*c, cache)]["vs_static"]) if (*c, cache) in cell else "not measured" for c in cols])
    skips = sum(r["cudagraph_skips"] for _, d in runs for r in d["rows"])
    graphs = {r["graphs"] for _, d in runs for r in d["rows"]}
    out += para(
        "**Compiled decode under CUDA graphs, x StaticCache** (`python eval/bench_compile.py --gpu-pass --batch B`, 4",
        "layers, `mode=\"reduce-overhead\"`, one run each; H200 batch 1: `eval/results/gpu_h200_compile/`, batch 8:",
        f"`gpu_h200_pass/compile-b8/`, H100: `call2`; {', '.join(sorted({day(d) for _, d in runs}))}; below 1 is",
        f"faster). CUDA graphs per cache: {', '.join(map(str, sorted(graphs)))}; skips: {skips}. Not measured: cut at",
        "the step's time limit.",
    )
    out += table(["cache"] + [f"{dev}, {ctx // 1024}K, B={b}" for dev, ctx, b in cols], body, "l" + "r" * len(cols))

    e1, e8 = load("gpu_h100/call1/e2e_b1.json"), load("gpu_h100/call1/e2e_b8.json")
    h1, h8 = load("gpu_h200_pass/e2e_b1.json.gz"), load("gpu_h200_pass/e2e_b8.json.gz")
    runs = [{r["cache"]: r for r in e["rows"]} for e in (e1, e8, h1, h8)]
    gain = {c: runs[3][c]["tok_per_s"] / runs[1][c]["tok_per_s"] for c in runs[1]
            if c in runs[3] and runs[1][c].get("tok_per_s") and runs[3][c].get("tok_per_s")}  # fmt: skip
    peaks = {c: runs[3][c]["peak_mib"] / runs[1][c]["peak_mib"] for c in e1["args"]["specs"]
             if runs[1].get(c, {}).get("peak_mib") and runs[3].get(c, {}).get("peak_mib")}  # fmt: skip
    evicting = [c for c in peaks if c.startswith(("sink:", "h2o:", "snapkv:"))]
    low_bit = [c for c in ("quantized:int4", "quantized:int2", "quantized:fp8", "paged-quantized:int4") if c in gain]
    out += para(
        f"**Eager decode** (`{command(e1)}` and `--batch 8`; {e1['args']['context'] // 1024}K context,",
        f"{e1['args']['new_tokens']} steps, {e1['args']['layers']} layers; x DynamicCache's tokens/s in the same run;",
        f"\"KV\": bytes at rest over DynamicCache's; peak: over weights). H100: the code of {day(e1)}; H200: of",
        f"{day(h8)}. From the H100 to the H200 at batch 8 DynamicCache's tokens/s grew {gain['dynamic']:.2f}x",
        f"(the H200's memory is faster), the KIVI caches' {min(gain[c] for c in low_bit):.2f}-"
        f"{max(gain[c] for c in low_bit):.2f}x ({', '.join(low_bit)}): their decode kernels reach a few percent of copy",
        "bandwidth (the kernels' table below), so a faster memory does little for them, and their ratio over",
        "DynamicCache falls. Peak memory over the H100's: "
        f"{min(v for c, v in peaks.items() if c not in evicting):.2f}-{max(v for c, v in peaks.items() if c not in evicting):.2f}x,"
        f" the evicting caches' {min(peaks[c] for c in evicting):.2f}-{max(peaks[c] for c in evicting):.2f}x.",
    )
    body = [["DynamicCache, tok/s"] + [f"{r['dynamic']['tok_per_s']:.1f}" for r in runs] + ["1.00"]
            + [f"{runs[i]['dynamic']['peak_mib']:,.0f}" for i in (1, 3)]]  # fmt: skip
    for cache in e1["args"]["specs"][1:]:
        got = [r.get(cache) for r in runs]
        if not any(x and x.get("tok_per_s") for x in got):
            continue
        kv = next(x for x in got if x and x.get("kv_vs_dynamic"))["kv_vs_dynamic"]
        body.append([cache] + [x2(x["vs_dynamic"]) if x and x.get("vs_dynamic") else "not measured" for x in got]
                    + [f"{kv:.2f}"] + [f"{got[i]['peak_mib']:,.0f}" if got[i] and got[i].get("peak_mib")
                                       else "not measured" for i in (1, 3)])  # fmt: skip
    out += table(["cache", "H100, B=1", "H100, B=8", "H200, B=1", "H200, B=8", "KV x bf16", "peak, H100, B=8 (MiB)",
                  "peak, H200, B=8 (MiB)"], body, "lrrrrrrr")  # fmt: skip

    p = load("gpu_h200_pass/peak_phases.json.gz")
    ph = {r["cache"]: r["phases"] for r in p["rows"]}
    pa = p["args"]
    out += para(
        f"**Where the peak comes from** (`{command(p)}`; {machine(p)}, {day(p)}; {pa['layers']} layers,",
        f"{pa['context'] // 1024}K context, batch {pa['batch']}, prefill chunks of {pa['prefill_chunk']}; MiB above each",
        f"phase's start; one layer's dense K/V {p['layer_kv_mib']:,.0f} MiB): the prefill peaks at",
        ", ".join(f"{ph[c]['prefill']['peak_mib']:,.0f} ({c})" for c in ph) + ": the model's forward of a chunk,",
        "DynamicCache's as much as the others'; in decode, the paged cache's first step",
        f"{ph['paged']['first decode step']['peak_mib']:,.0f} (one layer's K/V), its later steps",
        f"{ph['paged']['later decode steps']['peak_mib']:,.0f}, `quantized:int4`'s",
        f"{ph['quantized:int4']['later decode steps']['peak_mib']:,.0f}, DynamicCache's",
        f"{ph['dynamic']['later decode steps']['peak_mib']:,.0f} (its concatenation); both caches decode in their kernels.",
    )

    k = load("gpu_h200_eager/kernels.json.gz")
    ka = k["args"]
    rows = [r for r in k["rows"] if r["dtype"] == "bfloat16"]
    cols = list(dict.fromkeys((r["N"], r["B"]) for r in rows))
    cell = {(r["kernel"], r["N"], r["B"]): r for r in rows}
    groups = [["dense"], ["dense+mass"], ["paged"], ["int8", "int4", "int2", "fp8"], ["k4v2", "k3v2", "k2v2"]]
    last = cols[-1]
    body = [["SDPA (enable_gqa), us"] + [f"{cell[('sdpa (enable_gqa)', *c)]['time_us']:.1f}" for c in cols]
            + [f"{cell[('sdpa (enable_gqa)', *last)]['of_copy']:.0%}"]]  # fmt: skip
    for g in groups:
        body.append([" / ".join(g)] + [" / ".join(f"{cell[(name, *c)]['vs_sdpa']:.2f}" for name in g) for c in cols]
                    + [" / ".join(f"{cell[(name, *last)]['of_copy']:.0%}" for name in g)])  # fmt: skip
    out += para(
        f"**Decode-attention kernels** (`{command(k)}`; {machine(k)}, {day(k)}; Hq {ka['q_heads']}, Hkv {ka['kv_heads']}, head dim",
        f"{ka['head_dim']}, bf16; SDPA's time over the kernel's, so above 1 is faster; the last column: the share of",
        "copy bandwidth reached). Low-bit decode is a memory win on a GPU, not yet a speed win.",
    )
    out += table(["kernel"] + [f"{n // 1024}K, B={b}" for n, b in cols] + [f"of copy BW at {last[0] // 1024}K, B={last[1]}"],
                 body, "l" + "r" * (len(cols) + 1))  # fmt: skip

    o = load("gpu_h200_pass/offload.json.gz")
    by = {(r["cache"], r["batch"]): r for r in o["rows"]}
    big = max(r["batch"] for r in o["rows"])
    small = [r["vs_on_device"] for r in o["rows"] if r["batch"] == 1 and r["vs_on_device"] != 1.0]
    dense1 = by[("OffloadedCache dense", 1)]
    out += para(
        f"**Offloaded** (`{command(o)}`; {machine(o)}, {day(o)}), x DynamicCache on the device: at batch {big}",
        ", ".join(f"{c} {by[(c, big)]['tok_per_s']:.2f} tok/s ({by[(c, big)]['vs_on_device']:.2f}x)" if (c, big) in by
                  else f"{c} not measured (cut at the step's limit)"
                  for c in ("OffloadedCache dense", "OffloadedCache int4", "DynamicCache(offloading=True)")) + ";",
        f"at batch 1 {min(small):.2f}-{max(small):.2f}x, OffloadedCache keeping",
        f"{dense1['device_kv_bytes'] / 2**20:,.0f} MiB of KV on the device ({dense1['host_kv_bytes'] / 2**20:,.0f} MiB on the host)",
        f"and moving {dense1['achieved_gb_per_s']:.1f} GB/s, {dense1['fraction_of_pinned']:.0%} of the pinned copy bandwidth.",
    )

    t = load("gpu_h200_tests/tests.json")
    syncs, kern = t["tests-syncs"], t["tests-kernels"]
    out += para(
        f"**Tests on CUDA** (`{t['command']}` at {t['commit']}; {machine(t)}, {day(t)}; `eval/results/gpu_h200_tests/`):",
        f"{syncs['passed']} of {syncs['tests']} sync tests (no decode step syncs beyond DynamicCache's one) and",
        f"{kern['passed']} of {kern['tests']} kernel tests passed.",
    )
    with gzip.open(RESULTS / "gpu_h200_pass/tests-syncs.log.gz", "rt") as f:
        log = f.read()
    with gzip.open(RESULTS / "gpu_h200_pass/tests-key-scale-rotated.log.gz", "rt") as f:
        rotated = f.read()
    failed = sorted(set(re.findall(r"FAILED \S+no_synchronizing_cuda_call\[(.+?)-(?:unpadded|left-padded)\]", log)))
    summary = re.findall(r"(\d+) failed, (\d+) passed", rotated)[-1]
    out += para(
        f"On {day(h200)} (`gpu_h200_pass/`) {log.count(' PASSED ')} passed and {log.count(' FAILED ')} failed:",
        f"{', '.join(f'`{c}`' for c in failed)} synchronized 9 times a step against DynamicCache's 1 (scalars written",
        "through `torch.tensor`; a fill on the device since, and the CPU suite's count sees such copies now).",
        f"`tests/test_key_scale.py` and `test_rotated_kernels.py`: {summary[1]} passed, {summary[0]} failed, all key-scale",
        f"tests: {rotated.count('for generator but found')} drew from CPU generators under the CUDA default device (kept on",
        "the CPU since), 1 needs Gemma 3, which the GPU image cannot fetch.",
    )

    out += ["### Kernels compiled ahead of time", ""]
    parts = []
    for v in ("3.6.0", "3.9.0"):
        a = load(f"aot_sm90/triton-{v}.json.gz")
        ok = sum(r["status"] == "ok" for r in a["rows"])
        spills = []
        for kernel, name in (("_quant_split_kernel", "quantized"), ("_rotated_split_kernel", "rotated")):
            split = [r for r in a["rows"] if r["kernel"] == kernel]
            turning = [r for r in split if " turning " in r["spec"]]
            if split:
                spills.append(f"{sum(bool(r['spill_stores'] or r['spill_loads']) for r in split)} of {len(split)} {name}"
                              + (f" ({sum(bool(r['spill_stores'] or r['spill_loads']) for r in turning)} of"
                                 f" {len(turning)} with a turning centre)" if turning else ""))  # fmt: skip
        kernels = sorted({r["kernel"] for r in a["rows"]})
        parts.append(f"triton {v} ({day(a)}; {len(kernels)} kernels): {ok} of {len(a['rows'])} compile; split "
                     f"kernels that spill: {', '.join(spills)}")  # fmt: skip
    out += para(
        "`python -m hf_kvplus.kernels.aot --arch sm_90 --json eval/results/aot_sm90/triton-<version>.json` (stored",
        f"gzipped): {'; '.join(parts)}. Most spills come with float32 queries, head dim 256 or 32-query groups; the",
        "rotated formats' kernels and the turning centre's specializations came after the triton 3.6 run (the GPU",
        "image's triton), which a lent GPU is owed.",
    )
    return out


def page_header(title: str, *about: str) -> list[str]:
    """A linked page's title, the do-not-edit marker, and what it holds (`about`: the lines of one paragraph)."""
    return ["# Benchmarks: " + title, "",
            "<!-- Written by `python eval/report.py` from eval/results/; CI checks it (`--check`): do not edit. -->",
            ] + para(*about)  # fmt: skip


def lowbit_header() -> list[str]:
    return page_header(
        "low-bit formats",
        "The detail behind [BENCHMARKS.md](../BENCHMARKS.md)'s quality section: hf_kvplus's rotated formats (k4v2:",
        "4-bit keys and 2-bit values after a rotation; [docs/caches.md](caches.md)) on SmolLM2-135M, with exact",
        "regions, calibrated layers, value codebooks and the keys' turning centre.",
    )


def retrieval_header() -> list[str]:
    return page_header(
        "retrieval against bytes",
        "The detail behind [BENCHMARKS.md](../BENCHMARKS.md)'s retrieval section: which cache keeps the pass key for",
        "the bytes it holds ([docs/caches.md](caches.md) for the caches).",
    )


def cpu_header() -> list[str]:
    return page_header(
        "compiled decode and long contexts on the CPU",
        "The detail behind [BENCHMARKS.md](../BENCHMARKS.md)'s CPU speed section: `generate()` compiling the decode",
        "step ([docs/compile.md](compile.md)), each cache against StaticCache compiled the same way, lower is faster;",
        "then the eager host step, and eager decode at 1K, 4K and 16K tokens, against DynamicCache.",
    )


def host_step_cpu() -> list[str]:
    """The host step's table: each cache's eager decode step, inside and outside its kernels, against DynamicCache's."""
    run = load("host_cpu_step/host.json")
    a = run["args"]
    out = ["## Host cost of an eager decode step", ""]
    if "round_steps" in a:  # paired rounds (eval/bench_host.py): the median of per-round ratios
        how = (f"{a['repeats']} legs per cache of {a['steps']} steps each, in rounds of {a['round_steps']} steps of "
               "DynamicCache and of the cache, alternating; the median over rounds of the round's ratio,")
    else:
        how = f"the fastest of {a['repeats']} alternating runs,"
    out += para(
        f"`{command(run)}` ({where(run, 'host_cpu_step/')}): tiny 8-layer Llama, prompt {a['prompt']}, {how}",
        "CPU time of the thread; target 1.25x; \"outside\": the step less the time",
        "inside kernels; \"stubbed\": every kernel a stub returning zeros; calls: the cache code's Python calls per",
        "layer in the first decode step.",
    )
    body = [[r["cache"] if r["cache"] != "dynamic" else f"DynamicCache ({r['step_ms']:.3f} ms)", f"{r['vs_dynamic']:.2f}",
             f"{r['outside_vs_dynamic']:.2f}", f"{r['stubbed_vs_dynamic']:.2f}", f"{r['calls_per_layer']:.0f}",
             r["syncs_per_step"]] for r in run["rows"]]  # fmt: skip
    return out + table(["cache", "step x Dynamic", "outside kernels x Dynamic", "stubbed x Dynamic", "calls",
                        "syncs per step"], body, "lrrrrr")


#: The eager decode runs by the demo's protocol, by context: (folder, label).
EAGER_CPU_RUNS = (("cpu_decode_1k", "1K"), ("cpu_decode_4k", "4K"), ("cpu_decode_16k", "16K"))


def eager_decode_runs() -> list[tuple[dict, str]]:
    return [(load(f"{folder}/demo.json"), label) for folder, label in EAGER_CPU_RUNS]


def eager_decode_cpu() -> list[str]:
    """Eager decode of every cache against DynamicCache at 1K, 4K and 16K tokens, by the demo's protocol: blocks of each
    cache's steps alternating with DynamicCache's (at 16K the KV read outweighs the weights': SmolLM2-135M holds 755 MB
    of float32 KV against 540 MB of weights)."""
    runs = eager_decode_runs()
    cell = {(r["cache"], label): r for d, label in runs for r in d["rows"]}
    ordered = sorted(runs, key=lambda run: -len(run[0]["rows"]))  # the rows of the run with the most caches first
    caches = [c for c in dict.fromkeys(r["cache"] for d, _ in ordered for r in d["rows"]) if c != "dynamic"]

    def ratio(c: str, label: str) -> str:
        r = cell.get((c, label))
        if r is None:
            return "not measured"
        return f"{r['decode_vs_baseline']:.2f} ({r['decode_vs_baseline_min']:.2f}..{r['decode_vs_baseline_max']:.2f})"

    def baseline(d: dict, label: str) -> str:
        base = cell[("dynamic", label)]
        return (f"DynamicCache {base['decode_tok_s']:.1f} tokens/s, its own blocks {base['decode_vs_baseline_min']:.2f}.."
                f"{base['decode_vs_baseline_max']:.2f} over the run, within one cache's rounds "
                f"{d['timing']['baseline_spread']:.2f}x at most")

    out = ["## Eager decode by context length", ""]
    settings = "; ".join(
        f"{label}: `{command(d)}`, {day(d)}, {d['settings']['new_tokens']} steps in {d['settings']['rounds']} rounds, "
        f"{baseline(d, label)}" + ("" if d["timing"]["reliable"] else " (over the demo's threshold: noisy)")
        for d, label in runs
    )
    out += para(
        f"SmolLM2-135M in float32, {machine(runs[0][0])}, eager greedy decode after one prompt fed in chunks of 512 (the",
        "demo's protocol: blocks of each cache's steps alternating with DynamicCache's, the order flipped every round);",
        "median (min..max) of the rounds, x DynamicCache's tokens/s, higher is faster; evicting caches at an eighth of",
        f"4K; KV bytes at rest x DynamicCache's at 4K. {settings}.",
    )
    body = [[f"`{c}`"] + [ratio(c, label) for _, label in runs]
            + [x2(cell[(c, "4K")]["bytes_vs_baseline"]) if (c, "4K") in cell else "not measured"] for c in caches]  # fmt: skip
    return out + table(["cache"] + [f"decode x DynamicCache, {label}" for _, label in runs] + ["KV bytes, 4K"], body,
                       "l" + "r" * (len(runs) + 1))


#: Every page this writes (path under the repository) and its sections.
PAGES = {
    "BENCHMARKS.md": lambda: header() + demo() + quality() + retrieval() + memory() + persistence() + cpu_speed()
    + gpu_speed(),
    "docs/benchmarks-lowbit.md": lambda: lowbit_header() + two_families() + seed_spread() + references_gemma3() +
    exact_regions(),
    "docs/benchmarks-cpu.md": lambda: cpu_header() + compiled_cpu() + host_step_cpu() + eager_decode_cpu(),
    "docs/benchmarks-retrieval.md": lambda: retrieval_header() + needle_bytes(),
}


def render(page: str = "BENCHMARKS.md") -> str:
    lines = PAGES[page]()
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def limits(benchmarks: str, results: Path) -> list[str]:
    """What outgrew its limit: BENCHMARKS.md's lines, eval/results' bytes (the largest folders named)."""
    problems = []
    if benchmarks.count("\n") > MAX_LINES:
        problems.append(f"BENCHMARKS.md has {benchmarks.count(chr(10))} lines, over {MAX_LINES}: move detail to a "
                        "linked page (PAGES)")  # fmt: skip
    sizes = {}
    for path in results.rglob("*"):
        if path.is_file():
            top = path.relative_to(results).parts[0]
            sizes[top] = sizes.get(top, 0) + path.stat().st_size
    total = sum(sizes.values())
    if total > MAX_RESULTS_BYTES:
        largest = ", ".join(f"{name} {size / 2**20:.2f} MiB" for name, size in
                            sorted(sizes.items(), key=lambda item: -item[1])[:5])  # fmt: skip
        problems.append(f"eval/results holds {total / 2**20:.2f} MiB, over {MAX_RESULTS_BYTES / 2**20:.0f} MiB; "
                        f"largest: {largest}")
    return problems


def check(expected: str, actual: str, name: str = "BENCHMARKS.md", context: int = 1, limit: int = 40) -> list[str]:
    """The diff lines (at most `limit`) between what this writes and what the file holds; empty when equal."""
    if expected == actual:
        return []
    diff = list(difflib.unified_diff(actual.splitlines(), expected.splitlines(), f"{name} (committed)",
                                     f"{name} (python eval/report.py)", n=context, lineterm=""))  # fmt: skip
    return diff[:limit] + ([f"... {len(diff) - limit} more diff lines"] if len(diff) > limit else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 (with a diff) if a page is stale, or BENCHMARKS.md or eval/results too large")
    parser.add_argument("--root", type=Path, default=ROOT, help="where the pages are (default: the repository)")
    args = parser.parse_args(argv)
    texts = {page: render(page) for page in PAGES}
    if not args.check:
        for page, text in texts.items():
            (args.root / page).write_text(text)
            print(f"wrote {args.root / page} ({text.count(chr(10))} lines)")
        return 0
    status = 0
    for page, text in texts.items():
        path = args.root / page
        diff = check(text, path.read_text() if path.exists() else "", page)
        if diff:
            print("\n".join(diff))
            print(f"{page} is not what eval/report.py writes: run `python eval/report.py` and commit it.")
            status = 1
        else:
            print(f"{page} is current ({text.count(chr(10))} lines).")
    for problem in limits(texts["BENCHMARKS.md"], RESULTS):
        print(problem)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
