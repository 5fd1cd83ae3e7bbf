"""Bytes per tier of the offloaded caches after a prompt, read off the caches, in one run.

    python eval/offload_tiers.py --model smollm2-135m --tokens 4096 --host-mib 32 --out eval/results/offload_tiers_4k

Prefills `--tokens` of Pride and Prejudice (one forward per `--chunk` tokens) into DynamicCache (the
baseline, bytes summed over its layers), OffloadedCache in host memory, the same with the disk tier
beyond `--host-mib` MiB of host memory, and OffloadedCache int4; then runs one decode step (the disk
tier spills as layers are released) and reports each cache's bytes on the device, in host memory and
on disk, with the next-token logits' largest difference from the baseline's. Writes a Markdown
table and JSON.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvplus import OffloadedCache, cache_kwargs
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.resolve import load_model, load_text

MiB = 2**20
COLUMNS = [("cache", "cache", ""), ("device_mib", "device MiB", ".2f"), ("host_mib", "host MiB", ".2f"),
           ("disk_mib", "disk MiB", ".2f"), ("files", "files", "d"), ("max_logit_diff", "max |logit diff|", ".2e")]


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.no_grad()
def run(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Prefills `ids` in chunks, then one decode step; returns the decode step's logits."""
    for start in range(0, ids.shape[1] - 1, chunk):
        model(ids[:, start : min(start + chunk, ids.shape[1] - 1)], **cache_kwargs(cache))
    return model(ids[:, -1:], **cache_kwargs(cache)).logits[:, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--host-mib", type=int, default=32, help="host memory budget of the disk-tier cache")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[:, : args.tokens]
    folder = tempfile.mkdtemp(prefix="kvplus-tiers-")
    caches = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        "OffloadedCache (host)": lambda: OffloadedCache(model.config),
        f"OffloadedCache (disk beyond {args.host_mib} MiB)": lambda: OffloadedCache(
            model.config, host_budget=args.host_mib * MiB, folder=folder
        ),
        "OffloadedCache int4 (host)": lambda: OffloadedCache(model.config, bits=4),
    }
    rows, baseline = [], None
    for name, make in tqdm(caches.items(), desc="caches"):
        cache = make()
        logits = run(model, ids, cache, args.chunk)
        baseline = logits if baseline is None else baseline
        if isinstance(cache, DynamicCache):
            row = {"device_mib": dynamic_bytes(cache) / MiB, "host_mib": 0.0, "disk_mib": 0.0, "files": 0}
        else:
            tiers = cache.tier_bytes()
            disk = cache.placement.disk
            row = {"device_mib": tiers.device / MiB, "host_mib": tiers.host / MiB, "disk_mib": tiers.disk / MiB,
                   "files": len(disk.files()) if disk else 0}
        rows.append({"cache": name, **row, "max_logit_diff": float((logits - baseline).abs().max())})
        if isinstance(cache, OffloadedCache):
            cache.close()
    table = format_table(rows, COLUMNS)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = stamp() | {"model": args.model, "text": args.text, "tokens": int(ids.shape[1])}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    header = f"Bytes per tier after a {ids.shape[1]}-token prompt and one decode step ({args.model}, {meta['machine']})"
    (args.out / "results.md").write_text(f"# {header}\n\n`{meta['command']}`\n\n```\n{table}\n```\n")


if __name__ == "__main__":
    main()
