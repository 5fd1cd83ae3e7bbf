"""The reference comparisons on a second model, kept small: the runs of eval/compare_turboquant.py and
eval/compare_tiny_turboquant.py into one folder, merged into one `results.json` for eval/results (no plot, no log),
with hf_kvplus's rows taken from eval/lowbit_families.py's results where the protocol is the same.

    bash scripts/reference_venv.sh turboquant .venv-turboquant
    bash scripts/reference_venv.sh tiny-turboquant .venv-tiny-turboquant
    C="--model gemma3-270m --text austen:prideprejudice --tokens 4096 --chunks 32 --seeds 0 --threads 1 --out /tmp/refs"
    .venv-turboquant/bin/python eval/compare_turboquant.py $C --theirs-only --configs k4v2+mse k3v2+mse ...
    .venv-tiny-turboquant/bin/python eval/compare_tiny_turboquant.py $C --theirs-only --configs tiny:k4v2 ...
    python eval/lowbit_references.py --runs /tmp/refs [/tmp/refs_text2 ...] \
        --families eval/results/lowbit_families_4k/results.json --out eval/results/lowbit_references_gemma3

One folder per text (`--text`); the same model, tokens, chunk size and window in each. Where eval/lowbit_families.py
has run again (new presets, calibrations) and the reference runs are not at hand, `--refresh` takes an earlier merged
`results.json` and replaces only hf_kvplus's rows from `--families`, keeping every reference row:

    python eval/lowbit_references.py --refresh eval/results/lowbit_references_gemma3/results.json \
        --families eval/results/lowbit_families_4k/results.json --out eval/results/lowbit_references_gemma3

`results.json`: the settings, the commands, DynamicCache's perplexity per text, and per text one row per run as a list
(`columns`: series (short names in `series`), config, hf_kvplus's `defaults` or null, bits per coordinate, perplexity
change in %, and hf_kvplus's paired standard error of it).

hf_kvplus's rows: eval/lowbit_families.py's runs of the same model, text, tokens, chunk size and window, seed 0, as
the presets ship ("after": with the family's layer formats, `precision.FAMILY_DEFAULTS`) and with one format on every
layer ("before", `family_defaults=False`), and with the model's shipped calibration where run ("calibrated",
`calibration="auto"`), taken only if that run's DynamicCache perplexity is this one's (relative
difference under 1e-6: the same ids, chunks and model). Their rotation seed is 0; turboquant-torch's coded-once rows
(`+mse`, `+qjl`) are seed 0 too; tiny-turboquant has no randomness. Bits per coordinate as each script counts them
(eval/lowbit_compare.py's docstring): codes packed, norms, scales and zero points at float16, exact regions at
float32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAME_BASE = 1e-6
BASE = "DynamicCache"
OURS = "hf_kvplus"
ROTATED = ("k4v2", "k3v2", "k2v2")  # the presets taken from eval/lowbit_families.py


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def family_rows(path: Path, model: str, where: dict, base_ppl: float) -> list[dict]:
    """hf_kvplus's seed-0 rows from eval/lowbit_families.py's results.json, if its DynamicCache is this run's."""
    runs = json.loads(path.read_text())["runs"]
    same = {"model": model, "text": where["text"], "tokens": where["tokens"], "chunk": where["chunk"]}
    base = next((r for r in runs if r["spec"] == "dynamic" and all(r[k] == v for k, v in same.items())), None)
    if base is None:
        sys.exit(f"{path}: no DynamicCache run of {same}")
    if abs(base["perplexity"] / base_ppl - 1) > SAME_BASE:
        sys.exit(f"{path}: DynamicCache perplexity {base['perplexity']} is not this run's {base_ppl}")
    rows = []
    for r in runs:
        if (r["spec"] in ROTATED and r["seed"] == 0 and r["window"] == where["window"]
                and all(r[k] == v for k, v in same.items())):  # fmt: skip
            rows.append({"series": OURS, "config": r["spec"], "defaults": r["defaults"], "bits": r["bits"],
                         "delta_pct": r["delta_pct"], "se_pct": r.get("se_pct"), "perplexity": r["perplexity"]})
    return rows


def merge(folder: Path, families: Path | None) -> tuple[dict, dict, list[dict]]:
    """One compare folder (one text): its settings and stamp, DynamicCache's run, and every row (hf_kvplus's from
    `families`), each with its text."""
    runs = read_jsonl(folder / "runs.jsonl")
    metas = [json.loads((folder / name).read_text()) for name in ("turboquant.json", "tiny_turboquant.json")
             if (folder / name).exists()]  # fmt: skip
    meta = {k: v for k, v in metas[0].items() if k not in ("runs", "command", "seeds", "text", "renormalize",
                                                             "center_keys", "chunks")}  # fmt: skip
    meta["commands"] = [m["command"] for m in metas]
    for other in metas[1:]:
        meta.setdefault("versions_other", {}).update(other.get("versions_other", {}))
    bases = [r for r in runs if r["series"] == BASE]
    if len({(r["text"], r["tokens"], r["chunk"], r["window"]) for r in bases}) != 1:
        sys.exit(f"{folder}: one text, token count, chunk size and window per folder")
    base = bases[0]
    where = {k: base[k] for k in ("text", "tokens", "chunk", "window")}
    rows = [{"series": r["series"], "config": r["config"], "bits": r["bits_per_coordinate"],
             "delta_pct": r["delta_pct"], "perplexity": r["perplexity"]} for r in runs if r["series"] != BASE]
    if families:
        rows += family_rows(families, meta["model"], where, base["perplexity"])
    for r in rows:
        r["text"] = where["text"]
    return meta | {k: where[k] for k in ("tokens", "chunk", "window")}, base, rows


def packed(series: str, r: dict) -> list:
    """A row of `results.json` (`columns`): the series' short name, config, defaults, bits, change, standard error."""
    return ([series, r["config"], r.get("defaults"), round(r["bits"], 3), round(r["delta_pct"], 2)]
            + ([round(r["se_pct"], 2)] if r.get("se_pct") is not None else []))  # fmt: skip


def refresh(path: Path, families: Path) -> dict:
    """An earlier merged `results.json` with hf_kvplus's rows from eval/lowbit_families.py (those with a `defaults`)
    taken again from `families`; the references' rows and hf_kvplus's own compare runs (no `defaults`) kept."""
    result = json.loads(path.read_text())
    short = {name: key for key, name in result["series"].items()}
    for text, rows in result["rows"].items():
        where = {"text": text, "tokens": result["tokens"], "chunk": result["chunk"], "window": result["window"]}
        ours = family_rows(families, result["model"], where, result["dynamic"][text]["perplexity"])
        kept = [row for row in rows if not (result["series"][row[0]] == OURS and row[2] is not None)]
        kept += [packed(short[OURS], r) for r in ours]
        result["rows"][text] = sorted(kept, key=lambda row: (-row[3], row[0]))
    return result | {"hf_kvplus_from": str(families)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, nargs="+",
                        help="the compare scripts' --out folders, one per text")  # fmt: skip
    parser.add_argument("--refresh", type=Path, help="an earlier merged results.json: only hf_kvplus's rows are "
                                                     "taken again, from --families")  # fmt: skip
    parser.add_argument("--families", type=Path, help="eval/lowbit_families.py's results.json: hf_kvplus's rows")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", action="append", default=[],
                        help="a command that ran into the folders, in order (default: the last of each script)")
    args = parser.parse_args(argv)
    if args.refresh:
        if not args.families:
            parser.error("--refresh needs --families")
        result = refresh(args.refresh, args.families)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
        print(f"wrote {args.out / 'results.json'}")
        return
    if not args.runs:
        parser.error("give --runs (or --refresh)")
    merged = [merge(folder, args.families) for folder in args.runs]
    meta = merged[0][0]
    for other, _, _ in merged[1:]:
        if {k: other[k] for k in ("model", "tokens", "chunk", "window")} != {k: meta[k] for k in ("model", "tokens",
                                                                                                  "chunk", "window")}:
            sys.exit("the folders differ in model, tokens, chunk size or window")
        meta["commands"] += other["commands"]
    meta["commands"] = args.command or meta["commands"]
    rows = [r for _, _, mine in merged for r in mine]
    rows.sort(key=lambda r: (-r["bits"], r["series"]))
    series = {OURS: "ours", "turboquant-torch MSE keys, coded once": "tq_mse", "turboquant-torch QJL keys, coded once":
              "tq_qjl", "tiny-turboquant": "tiny", **{r["series"]: r["series"] for r in rows}}  # fmt: skip
    series = {name: series[name] for name in dict.fromkeys(r["series"] for r in rows)}
    small = {text: [packed(series[r["series"]], r) for r in rows if r["text"] == text]
             for text in dict.fromkeys(r["text"] for r in rows)}  # fmt: skip
    dynamic = {base["text"]: {"perplexity": round(base["perplexity"], 5), "seconds": round(base["seconds"])}
               for _, base, _ in merged}  # fmt: skip
    result = {**meta, "texts": list(dynamic), "dynamic": dynamic, "seed": 0,
              "hf_kvplus_from": str(args.families) if args.families else None,
              "series": {short: name for name, short in series.items()},
              "columns": ["series", "config", "defaults", "bits_per_coordinate", "delta_pct", "se_pct"],
              "rows": small}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    for text, mine in small.items():
        for row in mine:
            print(text[-12:], *row)
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
