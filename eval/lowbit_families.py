"""The low-bit presets on two model families, before and after the per-family defaults: one table from one command.

    python eval/lowbit_families.py --out eval/results/lowbit_families_4k
    python eval/lowbit_families.py --out eval/results/lowbit_families_4k --report-only   # the table from the runs kept
    python eval/lowbit_families.py --dry-run --out /tmp/lowbit_families_dry          # every row, tiny

Protocol: each `--models` on the first `--tokens` tokens of each `--texts`, fed in chunks of `--chunk`, a
`--window`-token full-precision window; perplexity change against DynamicCache on the same ids and chunks (measured
once per model and text). Each row is `QuantizedCache(bits=<spec>, window, rotation_seed=<seed>)` as it ships
("after": with its model family's key scale, layer formats and sinks, `precision.FAMILY_DEFAULTS`), as it ships but
with the full layers' first tokens in place of their sinks ("firsttokens": `full_sinks=0`, what shipped before them,
where the family keeps them), without any sinks ("nosinks": `sliding_sinks=0, full_sinks=0`), and with
`family_defaults=False, key_scale="off"` ("before": the preset's format on every layer and no key scale, what the
presets were before the work on a second family). Where a model has
no family defaults for a spec, these are the same cache: it runs once, as "same". `--calibration auto` runs instead
each spec with the calibration shipped for the model ("calibrated": `QuantizedCache(..., calibration="auto")`, found
from the config, `fitted.find`; and "calibrated-nosinks" without the sinks), into the same log, e.g.

    python eval/lowbit_families.py --out eval/results/lowbit_families_4k --models gemma3-270m --specs k2v2 k3v2 k4v2 \
        --calibration auto Bits per coordinate:
`quantized_report()["bits_per_coordinate"]` after the run (every token outside the window, exact regions counted at
their dtype's bits: float32 here).

Texts: `austen:prideprejudice` (the project's) and, held out, a technical text that neither model's artifacts were
fitted on and the project does not hold: Vim's reference manual on patterns (`/usr/share/vim/vim90/doc/pattern.txt`,
Debian's `vim-runtime`), a text of commands, syntax and prose unlike the novels.

Runs are appended to `runs.jsonl` in `--out` as they finish and a rerun skips those there (eval/results keeps only
`results.json`, whose runs stand in for the log). DynamicCache's per-token
log-likelihoods (for each row's paired standard error) go to `--scratch`, not to `--out`. Writes `results.json` (the
runs, small) and `table.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvplus import QuantizedCache
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.evaluation.report import stamp
from hf_kvplus.fitted import find
from hf_kvplus.formats import parse_bits
from hf_kvplus.precision import family_of
from hf_kvplus.resolve import load_model, load_text

VIM_PATTERNS = "/usr/share/vim/vim90/doc/pattern.txt"
TEXT_NAMES = {"austen:prideprejudice": "P&P", VIM_PATTERNS: "Vim patterns"}
MODEL_NAMES = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}
KIND_NAMES = {"before": "before", "nosinks": "after, no sinks", "firsttokens": "after, full layers' first tokens",
              "after": "after", "calibrated-nosinks": "calibrated, no sinks", "calibrated": "calibrated"}  # fmt: skip
#: The kinds in the order a table shows them.
KINDS = ("before", "nosinks", "firsttokens", "after", "calibrated-nosinks", "calibrated")
#: What each kind asks of `QuantizedCache` beyond the spec, the window and the seed.
KIND_OPTIONS = {"before": {"family_defaults": False, "key_scale": "off"}, "nosinks": {"sliding_sinks": 0, "full_sinks": 0},
                "firsttokens": {"full_sinks": 0}, "calibrated-nosinks": {"sliding_sinks": 0, "full_sinks": 0}}


def has_defaults(config, spec: str) -> bool:
    """Whether `spec` takes layer formats or sinks of its own on this model (`FAMILY_DEFAULTS`)."""
    family = family_of(config)
    return family is not None and (spec in family.kind_bits or spec in family.sliding_sinks or spec in family.full_sinks)


def keeps_sinks(config, spec: str, kind: str = "sliding") -> bool:
    """Whether `spec`'s layers of `kind` keep sinks beside their codes on this model (`FamilyDefaults.sliding_sinks`,
    `full_sinks`)."""
    family = family_of(config)
    return family is not None and spec in getattr(family, f"{kind}_sinks")


def plan(args, model_name: str, config) -> list[dict]:
    rows = []
    for text in args.texts:
        for spec in args.specs:
            sinks = keeps_sinks(config, spec)
            full = keeps_sinks(config, spec, "full")
            kinds = (["before"] + ["nosinks"] * sinks + ["firsttokens"] * full + ["after"]) if has_defaults(
                config, spec) else ["same"]  # fmt: skip
            if args.calibration:
                kinds = ["calibrated-nosinks"] * sinks + ["calibrated"]
            kinds = [kind for kind in kinds if not args.kinds or kind in args.kinds]
            for seed in args.seeds:
                rows += [{"model": model_name, "text": text, "spec": spec, "defaults": kind, "seed": seed,
                          "tokens": args.tokens, "chunk": args.chunk, "window": args.window} for kind in kinds]  # fmt: skip
    return rows


def key(row: dict) -> tuple:
    return tuple(row[k] for k in ("model", "text", "spec", "defaults", "seed", "tokens", "chunk", "window"))


def read_runs(path: Path) -> list[dict]:
    """The published results.json's runs, then those logged in `path` as they finished that it does not hold (a
    log started beside a published file holds only the runs since)."""
    published = path.with_name("results.json")
    runs = json.loads(published.read_text())["runs"] if published.exists() else []
    logged = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    known = {key(r) for r in runs}
    return runs + [r for r in logged if key(r) not in known]


def cell(runs: list[dict]) -> str:
    """`+x.xx% (b.bb)`: seed 0's change and bits; with more seeds, their mean too."""
    if not runs:
        return ""
    first = next((r for r in runs if r["seed"] == 0), runs[0])
    text = f"{first['delta_pct']:+.2f}% ({first['bits']:.2f})"
    if len(runs) > 1:
        text += f", mean {statistics.fmean(r['delta_pct'] for r in runs):+.2f}% ({len(runs)} seeds)"
    return text


def table(runs: list[dict]) -> str:
    """One table per text: a row per spec, before and after for each model."""
    quantized = [r for r in runs if r["spec"] != "dynamic"]
    models = list(dict.fromkeys(r["model"] for r in quantized))
    texts = list(dict.fromkeys(r["text"] for r in quantized))
    specs = list(dict.fromkeys(r["spec"] for r in quantized))
    out = []
    for text in texts:
        bases = {r["model"]: r for r in runs if r["spec"] == "dynamic" and r["text"] == text}
        base = "; ".join(f"{MODEL_NAMES.get(m, m)} {bases[m]['perplexity']:.3f}" for m in models if m in bases)
        some = next(r for r in quantized if r["text"] == text)
        out.append(f"**{TEXT_NAMES.get(text, text)}** ({some['tokens']} tokens, chunks of {some['chunk']}, window "
                   f"{some['window']}; DynamicCache perplexity {base}). Cells: perplexity change (bits per coordinate)."
                   "\n")  # fmt: skip
        kinds = {m: [k for k in KINDS
                     if k in ("before", "after") or any(r["model"] == m and r["defaults"] == k for r in quantized)]
                 for m in models}  # fmt: skip
        header = ["spec"] + [f"{MODEL_NAMES.get(m, m)} {KIND_NAMES[k]}" for m in models for k in kinds[m]]
        out.append("| " + " | ".join(header) + " |")
        out.append("| --- |" + " ---: |" * (len(header) - 1))
        for spec in specs:
            cells = [f"`quantized:{spec}`"]
            for model in models:
                mine = [r for r in quantized if (r["text"], r["spec"], r["model"]) == (text, spec, model)]
                same = [r for r in mine if r["defaults"] == "same"]
                for kind in kinds[model]:
                    runs_ = same if same and kind in ("before", "after") else [r for r in mine if r["defaults"] == kind]
                    cells.append(cell(runs_) + (" (same)" if same and kind == "after" else ""))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def report(runs: list[dict], meta: dict, out: Path) -> str:
    md = (f"Rotated presets before and after the per-family defaults; {meta['machine']}, {meta['date']}.\n\n"
          + "".join(f"`{c}`\n\n" for c in [meta["command"], *meta["added_commands"]]) + f"{table(runs)}\n"
          "before: the preset as it was before the work on the second family, its format on every layer and no key "
          "scale (`family_defaults=False, key_scale=\"off\"`); after: as it ships (Gemma 3: its key scale, the "
          "family's layer formats and sinks, `precision.FAMILY_DEFAULTS`); full layers' first tokens: the same with "
          "`full_sinks=0` (what shipped before the full layers' sinks); no sinks: with `sliding_sinks=0, full_sinks=0`; "
          "(same): no family defaults for that model and spec, one run; calibrated: "
          "`calibration=\"auto\"`, the calibration shipped for the model. Bits: "
          "`quantized_report()['bits_per_coordinate']`.\n")  # fmt: skip
    (out / "table.md").write_text(md)
    small = [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in runs]
    (out / "results.json").write_text(json.dumps({**meta, "runs": small}, separators=(",", ":")) + "\n")
    return md


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (runs.jsonl is extended there)")
    parser.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m"])
    parser.add_argument("--texts", nargs="+", default=["austen:prideprejudice", VIM_PATTERNS])
    parser.add_argument("--specs", nargs="+", default=["k2v2", "k3v2", "k4v2", "int4"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="rotation seeds")
    parser.add_argument("--calibration", choices=["auto"], help="run each spec with the model's shipped calibration "
                                                                "instead (rows 'calibrated')")  # fmt: skip
    parser.add_argument("--kinds", nargs="+", choices=[*KINDS, "same"],
                        help="run only these rows (e.g. more seeds of what ships: --kinds after --seeds 1 2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/lowbit_families"),
                        help="where DynamicCache's per-token log-likelihoods are kept between runs")
    parser.add_argument("--report-only", action="store_true", help="write the tables from runs.jsonl, measure nothing")
    parser.add_argument("--dry-run", action="store_true", help="every row tiny: 300 tokens, window 64, seed 0")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.tokens, args.window, args.seeds = 300, 64, args.seeds[:1]
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    runs = read_runs(log)
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"]
    command = "python eval/lowbit_families.py " + " ".join(given)
    published = args.out / "results.json"  # its runs extended: its commands kept, this one added
    earlier = json.loads(published.read_text()) if published.exists() else {}
    commands = [c for c in (earlier.get("command"), *earlier.get("added_commands", ())) if c]
    commands += [command] if command not in commands else []
    meta = {**stamp(), "command": commands[0], "added_commands": commands[1:],
            "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    if not args.report_only:
        done = {key(r) for r in runs}

        def record(row: dict) -> None:
            runs.append(row)
            with log.open("a") as handle:
                handle.write(json.dumps(row) + "\n")

        for model_name in args.models:
            model, tokenizer = load_model(model_name)
            todo = [r for r in plan(args, model_name, model.config) if key(r) not in done]
            # what ships first, on every text; then the presets before the family defaults; a KIVI format last
            todo.sort(key=lambda r: (r["seed"] != args.seeds[0], r["defaults"] == "before", r["spec"] == "int4",
                                     args.texts.index(r["text"])))  # fmt: skip
            for row in tqdm(todo, desc=f"{model_name} runs", unit="run"):
                text = row["text"]
                name = f"{model_name} {Path(text).name} t{args.tokens} c{args.chunk}"
                ids = tokenize(tokenizer, load_text(text), args.tokens)
                nll_file = args.scratch / (name.replace(" ", "_").replace(":", "_") + ".pt")
                base = {(r["model"], r["text"], r["tokens"], r["chunk"]): r for r in runs if r["spec"] == "dynamic"}
                where = (model_name, text, args.tokens, args.chunk)
                if where not in base or not nll_file.exists():
                    result = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=args.chunk,
                                        label=f"dynamic {name}")  # fmt: skip
                    torch.save(result.nll, nll_file)
                    if where not in base:
                        record({"model": model_name, "text": text, "spec": "dynamic", "defaults": "same", "seed": None,
                                "tokens": args.tokens, "chunk": args.chunk, "window": None,
                                "perplexity": result.perplexity, "seconds": result.seconds})  # fmt: skip
                        base[where] = runs[-1]
                base_nll = torch.load(nll_file).double()
                calibrated = {}
                if row["defaults"].startswith("calibrated"):
                    found = find(model.config, f"calibration/{parse_bits(row['spec'])}", "calibration.json")
                    calibrated = {"calibration": "auto"}
                    row["calibration"] = str(found.relative_to(Path(__file__).resolve().parent.parent)
                                             if found and found.is_relative_to(Path(__file__).resolve().parent.parent)
                                             else found)  # fmt: skip
                cache = QuantizedCache(model.config, bits=row["spec"], window=args.window, rotation_seed=row["seed"],
                                       **KIND_OPTIONS.get(row["defaults"], {}), **calibrated)  # fmt: skip
                result = perplexity(model, ids, cache, chunk_size=args.chunk, label=f"{row['spec']} {row['defaults']}")
                ratio = result.perplexity / base[where]["perplexity"]
                difference = result.nll.double() - base_nll
                report_ = cache.quantized_report()
                row |= {"perplexity": result.perplexity, "delta_pct": 100 * (ratio - 1),
                        "se_pct": 100 * ratio * float(difference.std() / difference.numel() ** 0.5),
                        "bits": report_["bits_per_coordinate"], "family_defaults": report_.get("family_defaults"),
                        "key_scale": report_.get("key_scale"),
                        "seconds": result.seconds}  # fmt: skip
                if not calibrated:  # (a calibrated row's are in its calibration file)
                    row["layer_bits"] = {str(i): b for i, b in cache.regions.layer_bits}
                elif cache.regions.layer_rotations:  # (said here too: they are why the row differs from "after")
                    row["layer_rotations"] = {str(i): seed for i, seed in cache.regions.layer_rotations}
                record(row)
                tqdm.write(f"{model_name} {Path(text).name} {row['spec']} {row['defaults']} seed {row['seed']}: "
                           f"{row['delta_pct']:+.3f}% +- {row['se_pct']:.3f} at {row['bits']:.3f} bits, "
                           f"{row['seconds']:.0f} s")  # fmt: skip
            del model
    print(report(runs, meta, args.out))


if __name__ == "__main__":
    main()
