"""Every decode-attention kernel against SDPA and against the copy bandwidth, on the same data.

    python eval/bench_kernels_gpu.py --out gpu-pass                   # 8K and 32K tokens, batch 1 and 8
    python eval/bench_kernels_gpu.py --out /tmp/p --dry-run           # CPU check, Triton interpreter

Decode attention is memory-bound: a step reads each cached key and value once. So each kernel is
timed against the bytes it must read (its storage: fp16/bf16 K/V, paged blocks, or codes plus
scales), as GB/s and as a fraction of a device copy of those bytes (read + write), and against
`scaled_dot_product_attention(enable_gqa=True)` over the full-precision K/V of the same tokens.
Kernels: dense, dense with per-key attention mass (H2O), paged (blocks of 16 in a shuffled pool),
and quantized int8/int4/int2/fp8 (KIVI layout, the default group sizes) and rotated k4v2/k3v2/k2v2 (the
dispatcher, which rotates the query and the output around the kernel: what a decode step pays). Llama-3.1-8B's attention
shape by default (32 query heads, 8 KV heads, head dim 128). Before timing, each kernel's output is
checked against a float64 reference on the same inputs (quantized kernels against the dequantized
K/V, which is what they must compute); the script exits with status 1 if one is off.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys

import torch
import torch.nn.functional as F
from gpu_common import add_common_args, copy_gb_per_s, median_ms, prepare, rel_err, write_step
from tqdm import tqdm

STEP = "kernels"
KINDS = ("dense", "dense+mass", "paged", "int8", "int4", "int2", "fp8", "k4v2", "k3v2", "k2v2")
#: ||out - ref|| / ||ref|| bounds against float64, per dtype (the output is rounded to it).
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
PAGED_BLOCK = 16

COLUMNS = [
    ("dtype", "dtype", ""),
    ("B", "B", "d"),
    ("N", "tokens", "d"),
    ("kernel", "kernel", ""),
    ("time_us", "time us", ".1f"),
    ("mb_read", "MB read", ".1f"),
    ("gb_per_s", "GB/s", ".0f"),
    ("of_copy", "of copy BW", ".0%"),
    ("vs_sdpa", "x SDPA", ".2f"),
    ("rel_err", "rel err", ".1e"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="cached tokens per row")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16", "float32"])
    p.add_argument("--kernels", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, in ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench measuring time, in ms")
    args = p.parse_args(argv)
    if args.dry_run:
        args.contexts, args.batch, args.q_heads, args.kv_heads, args.head_dim = [128], [2], 4, 2, 64
    return args


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def reference(q, k, v, scale, want_mass=False):
    """float64 softmax(q k^T * scale) v with each KV head's query group as rows (K/V never repeated);
    with `want_mass`, also each key's probability summed over the group [B, Hkv, N]."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.double().view(B, Hkv, Hq // Hkv, D)
    p = torch.softmax(torch.matmul(qg, k.double().transpose(-1, -2)) * scale, dim=-1)
    out = torch.matmul(p, v.double()).view(B, Hq, -1)
    return (out, p.sum(dim=2)) if want_mass else out


class Case:
    """One (dtype, batch, context): random K/V, the query, and a runner per kernel on that data."""

    def __init__(self, args, dtype, B, N, device):
        self.B, self.N, self.dtype, self.device = B, N, dtype, device
        Hq, Hkv, D = args.q_heads, args.kv_heads, args.head_dim
        self.q = torch.randn(B, Hq, D, device=device, dtype=dtype)
        self.k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
        self.v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(D)

    def sdpa(self):
        q4 = self.q[:, :, None]
        return functools.partial(
            F.scaled_dot_product_attention, q4, self.k, self.v, scale=self.scale, enable_gqa=True
        ), nbytes(self.k, self.v)

    def kernel(self, kind):
        """(callable, bytes it reads, float64 reference output, check(out) -> rel err)."""
        from hf_kvplus.kernels.decode_attention import (
            decode_attention_triton,
            decode_attention_with_mass_triton,
        )

        q, k, v, scale = self.q, self.k, self.v, self.scale
        if kind == "dense":
            fn = functools.partial(decode_attention_triton, q, k, v, scale=scale)
            return fn, nbytes(k, v), lambda out: rel_err(out, reference(q, k, v, scale))
        if kind == "dense+mass":
            fn = functools.partial(decode_attention_with_mass_triton, q, k, v, scale=scale)

            def check(result):
                out, mass = result
                ref, ref_mass = reference(q, k, v, scale, want_mass=True)
                return max(rel_err(out, ref), rel_err(mass, ref_mass))

            return fn, nbytes(k, v), check
        if kind == "paged":
            return self._paged()
        return self._quantized(kind)

    def _paged(self):
        from hf_kvplus.kernels.paged_attention import paged_decode_attention_triton

        q, k, v, scale = self.q, self.k, self.v, self.scale
        B, Hkv, N, D = k.shape
        per_row = N // PAGED_BLOCK
        # Row b's blocks are scattered through a shuffled pool, as after a while of serving.
        order = torch.randperm(B * per_row, device=self.device)
        table = order.view(B, per_row).to(torch.int32)
        k_pool = torch.empty(B * per_row, Hkv, PAGED_BLOCK, D, device=self.device, dtype=self.dtype)
        v_pool = torch.empty_like(k_pool)
        k_pool[order] = k.view(B, Hkv, per_row, PAGED_BLOCK, D).transpose(1, 2).reshape(-1, Hkv, PAGED_BLOCK, D)
        v_pool[order] = v.view(B, Hkv, per_row, PAGED_BLOCK, D).transpose(1, 2).reshape(-1, Hkv, PAGED_BLOCK, D)
        fn = functools.partial(paged_decode_attention_triton, q, k_pool, v_pool, table, start=0, length=N, scale=scale)
        return fn, nbytes(k_pool, v_pool, table), lambda out: rel_err(out, reference(q, k, v, scale))

    def _quantized(self, kind):
        from hf_kvplus.formats import DEFAULT_GROUP, parse_bits
        from hf_kvplus.kernels.dispatch import quantize_keys, quantize_values, quantized_decode_attention
        from hf_kvplus.kernels.quant_attention import quantized_decode_attention_triton
        from hf_kvplus.kernels.quant_format import PackedKV, QuantFormat, dequantize_keys, dequantize_values
        from hf_kvplus.kernels.rotated_format import RotatedFormat

        bits = parse_bits(kind)
        if isinstance(bits, str) and bits.startswith("k"):
            # A cache layer's format (keys centred), through the dispatcher that rotates q and the output.
            made = RotatedFormat(int(bits[1]), int(bits[3]))
            fmt, attend, state = made.for_layer(0), quantized_decode_attention, {"state": made.make_state()}
        else:
            fmt, attend, state = QuantFormat(bits, DEFAULT_GROUP[bits]), quantized_decode_attention_triton, {}
        kc, ks, kz = quantize_keys(self.k, fmt, **state)
        vc, vs, vz = quantize_values(self.v, fmt)
        packed = PackedKV(kc, ks, kz, vc, vs, vz)
        q, scale, N = self.q, self.scale, self.N
        fn = functools.partial(attend, q, packed, fmt, start=0, length=N, scale=scale, check=False, **state)

        def check(out):
            kd = dequantize_keys(kc, ks, kz, fmt, torch.float64, **state)
            vd = dequantize_values(vc, vs, vz, fmt, torch.float64)
            return rel_err(out, reference(q, kd, vd, scale))

        return fn, nbytes(kc, ks, kz, vc, vs, vz), check


def measure(case: Case, args, copy_cache: dict) -> list[dict]:
    """The SDPA row, then one row per kernel: accuracy first, then timing."""
    device = case.device

    def copy_bw(n):
        if n not in copy_cache:
            copy_cache[n] = copy_gb_per_s(n, device, args.warmup, args.rep)
        return copy_cache[n]

    base = {"dtype": str(case.dtype).removeprefix("torch."), "B": case.B, "N": case.N}
    sdpa, sdpa_bytes = case.sdpa()
    sdpa_ms = median_ms(sdpa, device, args.warmup, args.rep)
    rows = [{**base, "kernel": "sdpa (enable_gqa)", "time_us": sdpa_ms * 1e3, "bytes_read": sdpa_bytes}]
    for kind in args.kernels:
        fn, read, check = case.kernel(kind)
        err = check(fn())
        ms = median_ms(fn, device, args.warmup, args.rep)
        rows.append({**base, "kernel": kind, "time_us": ms * 1e3, "bytes_read": read, "rel_err": err,
                     "bound": BOUND[case.dtype], "ok": err < BOUND[case.dtype]})
    for row in rows:
        gbs = row["bytes_read"] / (row["time_us"] * 1e-6) / 1e9
        row.update(mb_read=row["bytes_read"] / 1e6, gb_per_s=gbs, copy_gb_per_s=copy_bw(row["bytes_read"]),
                   vs_sdpa=sdpa_ms * 1e3 / row["time_us"])
        row["of_copy"] = gbs / row["copy_gb_per_s"]
    return rows


def markdown(result: dict) -> str:
    from hf_kvplus.evaluation.report import format_table

    a = result["args"]
    failed = [r for r in result["rows"] if r.get("ok") is False]
    return "\n".join([
        "## Decode-attention kernels",
        "",
        f"Hq={a['q_heads']}, Hkv={a['kv_heads']}, head dim {a['head_dim']}; median of do_bench; "
        "'of copy BW': GB/s read over a device copy of the same bytes; 'x SDPA': SDPA's time over the kernel's.",
        "",
        "```",
        format_table(result["rows"], COLUMNS),
        "```",
        "",
        f"accuracy: {len(failed)} kernel outputs over their bound" + (
            ": " + ", ".join(f"{r['kernel']} {r['dtype']} B={r['B']} N={r['N']} ({r['rel_err']:.1e})" for r in failed)
            if failed else ""),
        "",
    ])


def main(argv=None) -> None:
    args = parse_args(argv)
    device = prepare(args.dry_run, "bench_kernels_gpu.py")
    from hf_kvplus.evaluation.report import stamp

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    result = {**stamp(), "dry_run": args.dry_run, "args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    result["args"].update(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    copy_cache: dict[int, float] = {}
    jobs = [(getattr(torch, d), B, N) for d in args.dtypes for N in args.contexts for B in args.batch]
    for dtype, B, N in tqdm(jobs, desc="dtype x context x batch", file=sys.stderr):
        case = Case(args, dtype, B, N, device)
        result["rows"].extend(measure(case, args, copy_cache))
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_step(args.out, STEP, result, markdown(result))
    print(markdown(result))
    if any(r.get("ok") is False for r in result["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
