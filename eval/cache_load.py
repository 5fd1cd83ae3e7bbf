"""What loading a saved cache costs against the prefill it replaces, and its bytes on disk against its bytes at rest.

    python eval/cache_load.py --threads 1 --tokens 4096 --repeats 3 \
        --cache dense --cache quantized:int4 --cache quantized:k4v2 --cache kvzip:0.15 \
        --out eval/results/cache_load_cpu_4k

Per cache spec, in one run: the prefill of the first `--tokens` tokens of the text (plus `compress`, KVzip's second
pass, for caches that have one: all of it is what a load replaces), once; `cache.save` and `load_cache`, `--repeats`
times each (the median is reported; the file is read back from the page cache, as a second question would); the next
token's logits of the loaded cache against the saved one's (they must be equal); the file's bytes against
`cache.nbytes`, the safetensors header (JSON: the cache's layout and graph) apart, and against the bytes at rest less
the growth headroom (`reserved_bytes`: allocated, never filled, not saved). Writes `cache_load.json` and
`cache_load.md` in `--out` after each cache spec (a run cut short keeps what it measured); `--append` adds the rows
to those already there (a spec measured again replaces its row), so that one spec can be measured in a later run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_kvplus import cache_kwargs, load_cache
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.resolve import load_model, load_text
from hf_kvplus.specs import parse_cache_spec


def measure(model, tokenizer, ids, spec: str, repeats: int, folder: Path) -> dict:
    cache = parse_cache_spec(spec).build(model.config, max_length=ids.shape[1] + 8)
    with torch.no_grad():
        start = time.perf_counter()
        model(ids, **cache_kwargs(cache), logits_to_keep=1)
        if hasattr(cache, "compress"):
            cache.compress(model, ids, tokenizer)
        prefill = time.perf_counter() - start
    path = folder / "cache.safetensors"
    report, rest = cache.memory_report(), cache.nbytes  # as saved: the check below steps the cache on
    saves, loads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        cache.save(path, spec=spec)
        saves.append(time.perf_counter() - start)
    for _ in range(repeats):
        start = time.perf_counter()
        loaded = load_cache(path, model.config)
        loads.append(time.perf_counter() - start)
    token = ids[:, -1:]
    with torch.no_grad():
        same = torch.equal(model(token, **cache_kwargs(loaded)).logits, model(token, **cache_kwargs(cache)).logits)
    with open(path, "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    disk = path.stat().st_size
    load = statistics.median(loads)
    filled = report.total_bytes - report.reserved_bytes
    return {
        "cache": spec, "tokens": ids.shape[1], "prefill_seconds": prefill, "save_seconds": statistics.median(saves),
        "load_seconds": load, "prefill_over_load": prefill / load, "bytes_at_rest": rest,
        "bytes_on_disk": disk, "header_bytes": header, "disk_less_header_over_rest": (disk - header) / rest,
        "headroom_bytes": report.reserved_bytes, "disk_less_header_over_filled": (disk - header) / filled,
        "same_next_logits": same, "tokens_held": report.tokens_held,
    }  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--cache", action="append", required=True, help="a cache spec (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("eval/results/cache_load_cpu_4k"))
    parser.add_argument("--append", action="store_true", help="add to the rows already in --out")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(load_text(args.text), return_tensors="pt", add_special_tokens=False)["input_ids"][:, : args.tokens]
    rows = []
    if args.append and (args.out / "cache_load.json").exists():
        rows = json.loads((args.out / "cache_load.json").read_text())["rows"]
    title = (f"{args.model}, first {ids.shape[1]} tokens of {args.text}, {torch.get_num_threads()} thread(s): "
             f"load_cache against the prefill it replaces (KVzip: prefill and compress), median of {args.repeats} "
             "loads")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for spec in args.cache:
            row = measure(model, tokenizer, ids, spec, args.repeats, Path(folder))
            rows = [r for r in rows if r["cache"] != spec] + [row]
            write(args.out, title, rows)


COLUMNS = [
    ("cache", "cache", ""), ("prefill_seconds", "prefill s", ".2f"), ("load_seconds", "load s", ".3f"),
    ("prefill_over_load", "prefill / load", ".1f"), ("save_seconds", "save s", ".3f"),
    ("bytes_at_rest", "bytes at rest", ",d"), ("headroom_bytes", "of it headroom", ",d"),
    ("bytes_on_disk", "bytes on disk", ",d"), ("header_bytes", "header", ",d"),
    ("disk_less_header_over_rest", "(disk - header) / rest", ".4f"),
    ("disk_less_header_over_filled", "(disk - header) / (rest - headroom)", ".4f"),
    ("same_next_logits", "same logits", ""),
]  # fmt: skip


def write(out: Path, title: str, rows: list[dict]) -> None:
    table = format_table(rows, [c for c in COLUMNS if all(c[0] in r for r in rows)])
    print(f"\n{title}\n\n{table}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_load.json").write_text(json.dumps({**stamp(), "title": title, "rows": rows}, indent=2))
    (out / "cache_load.md").write_text(f"{title}\n\n{table}\n")
    print(f"\nwrote {out}/cache_load.json, cache_load.md", flush=True)


if __name__ == "__main__":
    main()
