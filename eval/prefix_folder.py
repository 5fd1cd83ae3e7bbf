"""Processes asking about one document through a shared prefix folder, against each prefilling alone.

    python eval/prefix_folder.py --threads 1 --tokens 2048 --processes 3 --out eval/results/prefix_folder_cpu_2k

`--processes` processes in turn each load the model, build a `PagedCache` on a `PagedPool(prefix_backend=folder)`,
`reuse_prefix` the document (the first 2,048 tokens of the text plus a question that differs per process), generate
one token and `store_prefix`: the first finds nothing and stores the document's blocks, the later ones read them.
Each is followed at once by the same process without the folder, prefilling alone (a pair sees the same load on a
shared machine). Per process: time to the first token (from `reuse_prefix` to the generated token, the model already
loaded), blocks asked for and read back (hit rate), and the ratio of its time alone to its time with the folder. Writes `prefix_folder.json` and `prefix_folder.md` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hf_kvplus.evaluation.report import format_table, stamp

WORKER = """
import json, sys, time, torch
from hf_kvplus import PagedCache, PagedPool, cache_kwargs
from hf_kvplus.resolve import load_model, load_text
torch.set_num_threads({threads})
model, tokenizer = load_model({model!r})
ids = tokenizer(load_text({text!r}), return_tensors="pt", add_special_tokens=False)["input_ids"][:, : {tokens}]
question = tokenizer(" Question {index}: who speaks first?", return_tensors="pt", add_special_tokens=False)["input_ids"]
ids = torch.cat([ids, question], dim=1)
pool = PagedPool(model.config, block_size=16, prefix_backend={folder!r})
cache = PagedCache(model.config, pool=pool, namespace="doc")
start = time.perf_counter()
reused = cache.reuse_prefix(ids)
with torch.no_grad():
    model.generate(ids, **cache_kwargs(cache), max_new_tokens=1, do_sample=False)
ttft = time.perf_counter() - start
if {folder!r} is not None:
    cache.store_prefix(ids)
stats = pool.prefix_store.stats
print(json.dumps({{"ttft_seconds": ttft, "reused_tokens": reused, "query_blocks": stats.query_blocks,
                  "tier_hit_blocks": stats.tier_hit_blocks, "prompt_tokens": ids.shape[1]}}))
"""


def run(args, index: int, folder: str | None) -> dict:
    code = WORKER.format(threads=args.threads or 1, model=args.model, text=args.text, tokens=args.tokens, index=index,
                         folder=folder)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("eval/results/prefix_folder_cpu_2k"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # (the workers' count, which `stamp` records from this process)
    shared, alone = [], []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.processes):  # each pair back to back, so both see the same load on a shared machine
            shared.append(run(args, i, folder))
            alone.append(run(args, i, None))
    rows = []
    for i, (s, a) in enumerate(zip(shared, alone, strict=True)):
        rows.append({
            "process": i, "prompt_tokens": s["prompt_tokens"], "reused_tokens": s["reused_tokens"],
            "hit_rate": s["tier_hit_blocks"] / s["query_blocks"] if s["query_blocks"] else 0.0,
            "ttft_shared_seconds": s["ttft_seconds"], "ttft_alone_seconds": a["ttft_seconds"],
            "alone_over_shared": a["ttft_seconds"] / s["ttft_seconds"],
        })  # fmt: skip
    columns = [
        ("process", "process", "d"), ("prompt_tokens", "prompt", ",d"), ("reused_tokens", "reused", ",d"),
        ("hit_rate", "hit rate", ".0%"), ("ttft_shared_seconds", "first token, shared s", ".2f"),
        ("ttft_alone_seconds", "first token, alone s", ".2f"), ("alone_over_shared", "alone / shared", ".1f"),
    ]  # fmt: skip
    table = format_table(rows, columns)
    title = (f"{args.model}, {args.processes} processes in turn asking about the first {args.tokens} tokens of "
             f"{args.text} through one prefix folder, against each prefilling alone ({args.threads} thread(s))")
    print(f"\n{title}\n\n{table}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_folder.json").write_text(json.dumps({**stamp(), "title": title, "rows": rows}, indent=2))
    (args.out / "prefix_folder.md").write_text(f"{title}\n\n{table}\n")
    print(f"\nwrote {args.out}/prefix_folder.json, prefix_folder.md")


if __name__ == "__main__":
    main()
