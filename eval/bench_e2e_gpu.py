"""Every cache end to end on a Llama-3.1-8B-shaped model: decode tokens/s, peak memory, KV bytes.

    python eval/bench_e2e_gpu.py --out gpu-pass --batch 1            # 16K context, every spec
    python eval/bench_e2e_gpu.py --out gpu-pass --batch 8
    python eval/bench_e2e_gpu.py --out /tmp/p --dry-run              # CPU check: a tiny float32 model

The model has random bf16 weights in Llama 3.1 8B's shape (nothing downloaded). Each cache spec
gets a fresh cache, a prefill of `--context` random tokens (distinct per batch row, the same for
every spec), fed `--prefill-chunk` tokens per forward, then `--new-tokens` greedy decode steps
through `model(...)`, as `generate` makes them. DynamicCache (the baseline) and StaticCache are
measured in the same run. Reported per spec: decode tokens/s (all rows) and its ratio to
DynamicCache's, prefill seconds, KV bytes read off the cache, peak CUDA memory above the weights, and
whether the greedy tokens equal DynamicCache's. A spec that cannot run here (a missing package, out of
memory) is reported with its error, never silently dropped. One untimed short run per spec first, so
no row pays Triton compilation or CUDA start-up.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from gpu_common import LLAMA_31_8B, add_common_args, prepare, write_step
from tqdm import tqdm

STEP = "e2e"
#: The baseline first; the evicting caches keep a quarter of the 16K context.
SPECS = [
    "dynamic",
    "static",
    "dense",
    "paged",
    "quantized:int8",
    "quantized:int4",
    "quantized:int2",
    "quantized:fp8",
    "paged-quantized:int4",
    "sink:4:4092",
    "h2o:4096",
    "snapkv:4096",
    "offloaded",
    "offloaded-quantized:int4",
    "hf-quantized:quanto:4",  # last: optimum-quanto builds its extension on first use (minutes)
]
#: The evicting specs at a quarter of the dry run's 64-token context.
DRY_RUN_SPECS = {"sink:4:4092": "sink:4:12", "h2o:4096": "h2o:16", "snapkv:4096": "snapkv:16:observation=8"}
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)  # fmt: skip

COLUMNS = [
    ("cache", "cache", ""),
    ("batch", "batch", "d"),
    ("tok_per_s", "decode tok/s", ".1f"),
    ("vs_dynamic", "x Dynamic", ".2f"),
    ("prefill_s", "prefill s", ".2f"),
    ("kv_mib", "KV MiB", ",.0f"),
    ("kv_vs_dynamic", "KV x Dynamic", ".2f"),
    ("peak_mib", "peak MiB over weights", ",.0f"),
    ("same", "same tokens", ""),
    ("error", "error", ""),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--context", type=int, default=16384, help="prompt tokens prefilled before decoding")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=32, help="timed greedy decode steps")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill forward")
    p.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model (fewer: faster)")
    p.add_argument("--specs", nargs="+", default=SPECS, help="cache specs; the first is the baseline")
    args = p.parse_args(argv)
    if args.dry_run:
        args.context, args.new_tokens, args.prefill_chunk = 64, 3, 32
        args.specs = [DRY_RUN_SPECS.get(s, s) for s in args.specs]
    return args


def build_model(args, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**LLAMA_31_8B, **(TINY if args.dry_run else {"num_hidden_layers": args.layers})})
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(model, spec, prompt, args) -> dict:
    """One timed run of `spec` (after an untimed short one); a failure becomes the row's error."""
    from hf_kvplus.evaluation.benchmark import run_once

    row = {"cache": spec.text, "batch": prompt.shape[0], "context": prompt.shape[1], "lossless": spec.lossless}
    try:
        run_once(model, spec, prompt[:, : min(prompt.shape[1], args.prefill_chunk)], 2)
        free_memory(prompt.device)  # the warm-up's cache, collected before the peak's baseline is read
        run = run_once(model, spec, prompt, args.new_tokens, prefill_chunk=args.prefill_chunk)
    except torch.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    except Exception as exc:  # reported in the table: one cache failing must not hide the others
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    else:
        row.update(prefill_s=run["prefill_s"], tok_per_s=run["decode_tok_s"] * prompt.shape[0],
                   kv_bytes=run["bytes_at_rest"], peak_bytes=run["peak_bytes"], tokens=run["tokens"])
    return row


def compare(rows: list[dict]) -> None:
    """Ratios to the baseline of the same batch size (the first spec), and token agreement."""
    base = rows[0]
    for row in rows:
        if "error" in row or "error" in base:
            continue
        row["vs_dynamic"] = row["tok_per_s"] / base["tok_per_s"]
        row["kv_vs_dynamic"] = row["kv_bytes"] / base["kv_bytes"]
        same = torch.equal(row["tokens"], base["tokens"])
        row["same_tokens"] = same
        row["same"] = "-" if row is base else ("yes" if same else "no") + ("" if row["lossless"] else " (lossy)")
    for row in rows:
        row["kv_mib"] = row.get("kv_bytes", 0) / 2**20 if "kv_bytes" in row else None
        row["peak_mib"] = None if row.get("peak_bytes") is None else row["peak_bytes"] / 2**20


def markdown(result: dict) -> str:
    from hf_kvplus.evaluation.report import format_table

    a = result["args"]
    return "\n".join([
        "## End to end: Llama-3.1-8B-shaped model, random weights",
        "",
        f"{a['layers'] if not result['dry_run'] else 'tiny'} layers, context {a['context']}, {a['new_tokens']} timed "
        f"greedy steps, prefill {a['prefill_chunk']} tokens per forward; first spec is the baseline of its batch.",
        "",
        "```",
        format_table(result["rows"], COLUMNS),
        "```",
        "",
    ])


@torch.inference_mode()
def main(argv=None) -> None:
    args = parse_args(argv)
    device = prepare(args.dry_run, "bench_e2e_gpu.py")
    from hf_kvplus.evaluation.report import stamp
    from hf_kvplus.specs import parse_cache_spec

    specs = [parse_cache_spec(text) for text in args.specs]
    model = build_model(args, device)
    result = {**stamp(), "dry_run": args.dry_run, "args": vars(args), "rows": []}
    name = f"{STEP}_b{'_'.join(map(str, args.batch))}"
    for batch in args.batch:
        generator = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, model.config.vocab_size, (batch, args.context), generator=generator, device="cpu")
        prompt = prompt.to(device)
        rows = []
        for spec in tqdm(specs, desc=f"batch {batch}", file=sys.stderr):
            rows.append(measure(model, spec, prompt, args))
            free_memory(device)
            compare(rows)
            result["rows"] = [r for r in result["rows"] if r["batch"] != batch] + rows
            write_step(args.out, name, {**result, "rows": [strip(r) for r in result["rows"]]}, markdown(result))
    print(markdown(result))


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "tokens"}


if __name__ == "__main__":
    main()
