"""Offloaded KV caches against an on-device DynamicCache on a GPU, baseline measured in the same run.

    python eval/bench_offload_gpu.py --context 16384 --batch 1 4 --new-tokens 32 --out gpu-pass
    python eval/bench_offload_gpu.py --dry-run --context 256 --batch 1 2 --new-tokens 4 --out /tmp/offload_smoke

A Llama-3.1-8B-shaped model with random bf16 weights (nothing downloaded) prefills `--context` random
tokens, `--prefill-chunk` tokens per forward, then decodes `--new-tokens` greedily after `--warmup`
untimed steps, once per batch size and cache: DynamicCache on the device (the baseline), hf_kvplus's
OffloadedCache dense and int4, and Transformers' DynamicCache(offloading=True). Reported per row: KV
bytes on the device and in host memory right after a decode step, peak CUDA memory above the weights,
prefill seconds, decode tokens/s against the baseline, the host-to-device bytes of one decode step
(every offloaded layer comes over the bus once a step) and the bandwidth that achieves, as a fraction
of the pinned host-to-device bandwidth measured at the start; and whether the greedy tokens equal the
baseline's. Results go to `offload.json` and `offload.md` in `--out`. `--dry-run` is a CPU smoke test (4 layers, hidden 256, float32): no bus is crossed there and
Transformers' offloading, which needs CUDA, is reported unavailable.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product

import torch
from gpu_common import LLAMA_31_8B, add_common_args, write_step
from gpu_env import pinned_bandwidth
from tqdm import tqdm
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import hf_kvplus
from hf_kvplus import cache_kwargs
from hf_kvplus.evaluation.report import format_table, stamp

MiB = 2**20

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=32000,
)

COLUMNS = [
    ("cache", "cache", ""),
    ("batch", "batch", "d"),
    ("device_mib", "device KV MiB", ".1f"),
    ("host_mib", "host KV MiB", ".1f"),
    ("peak_mib", "peak MiB over weights", ".0f"),
    ("prefill_s", "prefill s", ".2f"),
    ("tok_per_s", "decode tok/s", ".2f"),
    ("vs_on_device", "vs on-device", ".3f"),
    ("moved_mib", "MiB/step moved", ".1f"),
    ("achieved_gb_per_s", "GB/s achieved", ".2f"),
    ("of_pinned", "of pinned BW", ".1%"),
    ("same", "same tokens", ""),
    ("note", "note", ""),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--context", type=int, default=16384, help="prompt tokens prefilled before decoding")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=32, help="timed greedy decode steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill forward")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of each pinned copy timed")
    p.add_argument("--bandwidth-repeats", type=int, default=10)
    args = p.parse_args(argv)
    if args.dry_run:
        args.context, args.new_tokens, args.prefill_chunk, args.warmup = 256, 4, 128, 1
    return args


def build_model(tiny: bool):
    """Random weights in Llama 3.1 8B's shape (or a tiny one), with the default "sdpa" attention that
    hf_kvplus routes its caches through."""
    config = LlamaConfig(**{**LLAMA_31_8B, **(TINY if tiny else {})})
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@dataclass(frozen=True)
class Tiers:
    """KV bytes on the compute device and in host memory, and those brought to the device each step
    (None for a cache that keeps everything on the device)."""

    device: int
    host: int
    moved: int | None


def layer_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)


def on_device_tiers(cache) -> Tiers:
    return Tiers(device=sum(layer_bytes(layer) for layer in cache.layers), host=0, moved=None)


def kvplus_tiers(cache) -> Tiers:
    """Read off the placement; every layer at rest is copied in once a step. Without CUDA the host is
    the compute device and only a disk tier would move bytes."""
    tiers = cache.tier_bytes()
    moved = tiers.host + tiers.disk if cache.placement.device.type == "cuda" else tiers.disk
    return Tiers(device=tiers.device, host=tiers.host + tiers.disk, moved=moved)


def transformers_offloaded_tiers(cache) -> Tiers:
    """Where each layer's tensors are now; every offloaded layer is prefetched once a step (and copied
    back whole, which the moved bytes leave out)."""
    offloaded = [layer for layer in cache.layers if not (layer.is_sliding and cache.only_non_sliding)]
    on_host = [layer for layer in cache.layers if layer.keys is not None and layer.keys.device.type == "cpu"]
    host = sum(layer_bytes(layer) for layer in on_host)
    return Tiers(
        device=sum(layer_bytes(layer) for layer in cache.layers) - host,
        host=host,
        moved=sum(layer_bytes(layer) for layer in offloaded),
    )


@dataclass(frozen=True)
class CacheKind:
    """A cache under test: how to build it, where its bytes are, and whether it should decode the
    baseline's tokens. `may_fail`: a failure is recorded as the cache being unavailable here."""

    name: str
    make: Callable
    tiers: Callable[[object], Tiers]
    lossless: bool = True
    may_fail: bool = False


KINDS = [
    CacheKind("DynamicCache (on device)", lambda config: DynamicCache(config=config), on_device_tiers),
    CacheKind("OffloadedCache dense", lambda config: hf_kvplus.OffloadedCache(config), kvplus_tiers),
    CacheKind(
        "OffloadedCache int4", lambda c: hf_kvplus.OffloadedCache(c, bits=4), kvplus_tiers, lossless=False
    ),
    CacheKind(
        "DynamicCache(offloading=True)",
        lambda config: DynamicCache(config=config, offloading=True),
        transformers_offloaded_tiers,
        may_fail=True,
    ),
]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy(model, cache, input_ids) -> torch.Tensor:
    """One forward; the argmax of its last position, shaped (batch, 1) to be fed back."""
    logits = model(input_ids=input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
    return logits[:, -1:].argmax(-1)


def prefill(model, cache, prompt, chunk: int) -> torch.Tensor:
    """Chunked, so activations stay bounded at long contexts; returns the first greedy token."""
    for start in range(0, prompt.shape[1], chunk):
        token = greedy(model, cache, prompt[:, start : start + chunk])
    return token


def decode(model, cache, token, steps: int, chosen: list) -> torch.Tensor:
    """`steps` greedy tokens one at a time, appended to `chosen`; returns the last."""
    for _ in range(steps):
        token = greedy(model, cache, token)
        chosen.append(token)
    return token


@torch.no_grad()
def measure(model, kind: CacheKind, prompt, args) -> tuple[dict, torch.Tensor]:
    """Prefill and decode with a fresh cache; returns the row and the greedy tokens. Under `no_grad`,
    as `generate` runs."""
    device = prompt.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    cache = kind.make(model.config)
    start = time.perf_counter()
    token = prefill(model, cache, prompt, args.prefill_chunk)
    synchronize(device)
    prefill_s = time.perf_counter() - start
    chosen = [token]
    token = decode(model, cache, token, args.warmup, chosen)
    synchronize(device)
    start = time.perf_counter()
    decode(model, cache, token, args.new_tokens, chosen)
    synchronize(device)
    step_s = (time.perf_counter() - start) / args.new_tokens
    tiers = kind.tiers(cache)
    peak = torch.cuda.max_memory_allocated(device) - weights if device.type == "cuda" else None
    row = {
        "prefill_s": prefill_s,
        "decode_step_s": step_s,
        "tok_per_s": prompt.shape[0] / step_s,
        "device_kv_bytes": tiers.device,
        "host_kv_bytes": tiers.host,
        "peak_above_weights_bytes": peak,
        "moved_bytes_per_step": tiers.moved,
        "achieved_gb_per_s": None if tiers.moved is None else tiers.moved / step_s / 1e9,
    }
    return row, torch.cat(chosen, 1).cpu()


def free_memory() -> None:
    """Drops the last cache (host memory pinned by offloaded ones included) before the next is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompt(model, batch: int, context: int) -> torch.Tensor:
    """Seeded by the batch size, so every cache of a batch size reads the same tokens."""
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(0, model.config.vocab_size, (batch, context), generator=generator).to(model.device)


def warm_up(model, args) -> None:
    """Every cache once, untimed, on a one-chunk prompt: the first timed row then pays no CUDA/cuBLAS
    start-up or Triton compilation."""
    prompt = random_prompt(model, args.batch[0], min(args.context, args.prefill_chunk))
    for kind in KINDS:
        with contextlib.suppress(Exception) if kind.may_fail else contextlib.nullcontext():
            measure(model, kind, prompt, args)
        free_memory()


def run(model, args, bandwidth: dict | None, on_row: Callable[[list[dict]], object]) -> list[dict]:
    """Every (batch, cache) pair on the same prompt per batch; the on-device baseline first. `on_row` gets
    the rows so far after each one, so a run cut at its time limit keeps what it measured."""
    rows, baseline = [], {}
    for batch, kind in tqdm(list(product(args.batch, KINDS)), desc="batch x cache", file=sys.stderr):
        prompt = random_prompt(model, batch, args.context)
        row = {"cache": kind.name, "batch": batch, "context": args.context, "lossless": kind.lossless}
        try:
            measured, tokens = measure(model, kind, prompt, args)
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        except Exception as exc:
            if not kind.may_fail:
                raise
            row["error"] = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        else:
            row.update(measured)
            if kind is KINDS[0]:
                baseline[batch] = (measured["tok_per_s"], tokens)
            if batch in baseline:
                base_tok_per_s, base_tokens = baseline[batch]
                row["vs_on_device"] = measured["tok_per_s"] / base_tok_per_s
                row["same_tokens"] = torch.equal(tokens, base_tokens)
            if bandwidth and row["achieved_gb_per_s"] is not None:
                row["fraction_of_pinned"] = row["achieved_gb_per_s"] / bandwidth["gb_per_s"]
        rows.append(row)
        on_row(rows)
        free_memory()
    return rows


def table_row(row: dict) -> dict:
    """A JSON row as the Markdown table shows it: MiB, and what "same tokens" means for a lossy cache."""

    def mib(key):
        return None if row.get(key) is None else row[key] / MiB

    same = row.get("same_tokens")
    if row["cache"] == KINDS[0].name or same is None:
        same_text = "-"
    else:
        same_text = ("yes" if same else "no") + ("" if row["lossless"] else " (lossy)")
    return {
        **row,
        "device_mib": mib("device_kv_bytes"),
        "host_mib": mib("host_kv_bytes"),
        "peak_mib": mib("peak_above_weights_bytes"),
        "moved_mib": mib("moved_bytes_per_step"),
        "of_pinned": row.get("fraction_of_pinned"),
        "same": same_text,
        "note": row.get("error", ""),
    }


def write_results(args, info: dict, bandwidth: dict | None, rows: list[dict]) -> str:
    """offload.json (everything) and offload.md (stamp, bandwidth, table); returns the Markdown."""
    model = "tiny Llama (CPU, float32)" if args.dry_run else "Llama-3.1-8B-shaped, random bf16 weights"
    ceiling = "n/a (no CUDA)" if bandwidth is None else f"{bandwidth['gb_per_s']:.2f} GB/s (median)"
    md = "\n".join(
        [
            "## Offloaded KV caches vs on-device DynamicCache",
            "",
            f"- device: {info['machine']}",
            f"- date: {info['date']}",
            f"- torch {info['versions']['torch']}, transformers {info['versions']['transformers']}",
            f"- command: `python {info['command']}`",
            f"- model: {model}; context {args.context}, {args.new_tokens} timed decode steps after "
            f"{args.warmup} warm-up, prefill {args.prefill_chunk} tokens per forward",
            f"- pinned host-to-device bandwidth: {ceiling}",
            "",
            "```",
            format_table([table_row(row) for row in rows], COLUMNS),
            "```",
            "",
            "Device KV: bytes on the device right after a decode step (OffloadedCache: the layer in use and "
            "the one being fetched). MiB/step moved: host-to-device bytes of one decode step, every "
            "offloaded layer once, headroom and quantization scales included; the write-back is left out "
            "(OffloadedCache writes back the new token, Transformers' offloading copies every layer back "
            "whole). Same tokens: greedy tokens equal to the on-device DynamicCache's for the same prompt.",
            "",
        ]
    )
    result = {
        **info,
        "args": {k: str(v) for k, v in vars(args).items()},
        "pinned_bandwidth": bandwidth,
        "rows": rows,
    }
    write_step(args.out, "offload", result, md)
    return md


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_offload_gpu.py needs a CUDA device (or --dry-run for the CPU smoke test)")
    model = build_model(args.dry_run)
    bandwidth = None if args.dry_run else pinned_bandwidth(int(args.bandwidth_gib * 2**30), args.bandwidth_repeats)
    free_memory()
    warm_up(model, args)
    info = stamp()
    rows = run(model, args, bandwidth, lambda rows: write_results(args, info, bandwidth, rows))
    print(write_results(args, info, bandwidth, rows))


if __name__ == "__main__":
    main()
