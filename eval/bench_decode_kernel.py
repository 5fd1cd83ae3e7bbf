"""Benchmark the split-KV decode-attention Triton kernel against SDPA and the copy bandwidth (CUDA only).

Decode attention is memory-bound: each step reads the whole K/V once. So the kernel is timed against
bytes moved: achieved GB/s = bytes of K+V read / time, compared with a device-to-device copy of the
same bytes (copy bandwidth = bytes read + bytes written / time), and against torch SDPA on the same data.

    python eval/bench_decode_kernel.py --out eval/results/decode_kernel.json

First, for each dtype, the kernel is checked against a float64 reference on fresh random data; the
script exits with status 1 (after writing the JSON) if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys

import torch
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path of the JSON file to write")
    p.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16,bfloat16,float32")
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes")
    p.add_argument("--gib", type=float, default=1.0, help="K+V size in GiB (N is chosen to match)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--num-splits", type=int, default=None, help="Triton splits (default: automatic)")
    p.add_argument("--mask", action="store_true", help="left-padding bool mask for all")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, in ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench measuring time, in ms")
    p.add_argument("--no-repeat-kv", action="store_true", help="skip SDPA with repeat_kv (G x memory)")
    return p.parse_args(argv)


def progress(items, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, file=sys.stderr)


def reference(q, k, v, scale, mask):
    """float64 softmax(q k^T * scale + mask) v over the repeated KV heads."""
    G = q.shape[1] // k.shape[1]
    kd = k.double().repeat_interleave(G, dim=1)
    vd = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), kd) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        p = torch.where(mask.any(dim=-1)[:, None, None], p, torch.zeros_like(p))
    return torch.einsum("bhn,bhnd->bhd", p, vd)


def left_padding_mask(B, N, device):
    # Row b is padded on the left by b * N / (2 * B) keys: realistic batched generation.
    mask = torch.ones(B, N, dtype=torch.bool, device=device)
    for b in range(B):
        mask[b, : (b * N) // (2 * B)] = False
    return mask


def check_accuracy(dtype, args):
    """Fresh random inputs, several shapes; returns a list of result dicts."""
    from hf_kvplus.kernels.decode_attention import decode_attention_triton

    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    results = []
    shapes = [  # B, Hq, Hkv, N, D, Dv, num_splits
        (2, args.q_heads, args.kv_heads, 4099, args.head_dim, args.head_dim, None),
        (3, 12, 4, 1000, 80, 80, 7),
        (1, 8, 1, 20000, 64, 64, None),
        (2, 8, 2, 777, 256, 256, 1),
        (2, 9, 3, 513, 64, 96, 1000),
    ]
    for B, Hq, Hkv, N, D, Dv, ns in shapes:
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, Hkv, N + 64, D, device="cuda", dtype=dtype)[:, :, :N]  # a view, as in a cache
        v = torch.randn(B, Hkv, N + 64, Dv, device="cuda", dtype=dtype)[:, :, :N]
        mask = left_padding_mask(B, N, "cuda")
        scale = 1.0 / math.sqrt(D)
        out = decode_attention_triton(q, k, v, scale=scale, mask=mask, num_splits=ns)
        ref = reference(q, k, v, scale, mask)
        finite = bool(torch.isfinite(out).all())
        err = ((out.double() - ref).norm() / ref.norm()).item() if finite else float("nan")
        results.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "B": B,
                "Hq": Hq,
                "Hkv": Hkv,
                "N": N,
                "D": D,
                "Dv": Dv,
                "num_splits": ns,
                "rel_err": err,
                "bound": bound,
                "ok": finite and err < bound,
            }
        )
    return results


def copy_bandwidth(nbytes, args):
    """GB/s of a device-to-device copy of nbytes: (bytes read + bytes written) / time."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(
        lambda: dst.copy_(src), warmup=args.warmup, rep=args.rep, return_mode="median"
    )
    return 2 * nbytes / (ms * 1e-3) / 1e9


def time_one(dtype, B, args, sm_count):
    """Time every implementation and the copy on about args.gib GiB of K+V; returns one row per impl."""
    import triton
    import triton.testing

    from hf_kvplus.kernels.decode_attention import (
        _block_n,
        decode_attention_torch,
        decode_attention_triton,
        pick_num_splits,
    )

    Hq, Hkv, D = args.q_heads, args.kv_heads, args.head_dim
    G = Hq // Hkv
    rows = []
    esize = torch.tensor([], dtype=dtype).element_size()
    N = int(args.gib * 2**30) // (2 * B * Hkv * D * esize)
    kv_bytes = 2 * B * Hkv * N * D * esize
    q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype)
    mask = left_padding_mask(B, N, "cuda") if args.mask else None
    sdpa_mask = None if mask is None else mask[:, None, None, :]
    scale = 1.0 / math.sqrt(D)
    q4 = q[:, :, None, :]  # [B, Hq, 1, D]

    def repeat_kv(x):
        # What transformers' repeat_kv does: materialize the K/V heads G times.
        return x[:, :, None].expand(B, Hkv, G, N, D).reshape(B, Hq, N, D)

    impls = {
        "triton": lambda: decode_attention_triton(
            q, k, v, scale=scale, mask=mask, num_splits=args.num_splits
        ),
        "sdpa_enable_gqa": lambda: F.scaled_dot_product_attention(
            q4, k, v, attn_mask=sdpa_mask, scale=scale, enable_gqa=True
        ),
        "sdpa_packed_group": lambda: decode_attention_torch(q, k, v, scale=scale, mask=mask),
    }
    if not args.no_repeat_kv:
        impls["sdpa_repeat_kv"] = lambda: F.scaled_dot_product_attention(
            q4, repeat_kv(k), repeat_kv(v), attn_mask=sdpa_mask, scale=scale
        )

    copy_gbs = copy_bandwidth(kv_bytes, args)
    times = {}
    for name, fn in impls.items():
        times[name] = triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
    d_pad = max(16, triton.next_power_of_2(D))
    auto_splits = pick_num_splits(B, Hkv, N, _block_n(d_pad, d_pad, esize), sm_count)
    for name, ms in times.items():
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "B": B,
                "Hq": Hq,
                "Hkv": Hkv,
                "N": N,
                "D": D,
                "kv_bytes": kv_bytes,
                "impl": name,
                "time_us": ms * 1e3,
                "gb_per_s": gbs,
                "copy_gb_per_s": copy_gbs,
                "frac_of_copy_bw": gbs / copy_gbs,
                "speedup_vs_sdpa_enable_gqa": times["sdpa_enable_gqa"] / ms,
                # As requested (the wrapper clamps it to the number of tiles), or the automatic choice.
                "num_splits": (args.num_splits or auto_splits) if name == "triton" else None,
            }
        )
    return rows


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode_kernel.py needs a CUDA device")
    import triton  # here, so that --help works where triton or the package is missing

    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    props = torch.cuda.get_device_properties(0)

    checks = []
    for dtype in progress(dtypes, "accuracy"):
        checks.extend(check_accuracy(dtype, args))

    rows = []
    jobs = [(dtype, B) for dtype in dtypes for B in batches]
    for dtype, B in progress(jobs, "timing"):
        rows.extend(time_one(dtype, B, args, props.multi_processor_count))
        torch.cuda.empty_cache()

    print(f"\n{props.name}, torch {torch.__version__}, triton {triton.__version__}, seed {seed}")
    print("\naccuracy (rel err vs float64):")
    for c in checks:
        verdict = "ok" if c["ok"] else "FAIL"
        print(
            f"  {c['dtype']:9s} B={c['B']} Hq={c['Hq']} Hkv={c['Hkv']} N={c['N']} D={c['D']} Dv={c['Dv']} "
            f"splits={c['num_splits']}: {c['rel_err']:.2e} (bound {c['bound']:.0e}) {verdict}"
        )
    head = (
        f"{'dtype':9s} {'B':>2s} {'N':>7s} {'impl':18s} {'time us':>9s} {'GB/s':>7s} {'of copy':>7s} "
        f"{'vs sdpa':>7s}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['dtype']:9s} {r['B']:2d} {r['N']:7d} {r['impl']:18s} {r['time_us']:9.1f} "
            f"{r['gb_per_s']:7.0f} {r['frac_of_copy_bw']:7.2f} {r['speedup_vs_sdpa_enable_gqa']:7.2f}"
        )
    copies = {(r["dtype"], r["B"]): r["copy_gb_per_s"] for r in rows}
    copy_text = ", ".join(f"{k[0]} B={k[1]}: {v:.0f}" for k, v in copies.items())
    print(f"copy bandwidth (read + write) GB/s: {copy_text}")

    result = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "seed": seed,
        "args": vars(args),
        "accuracy": checks,
        "timing": rows,
    }
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    if not all(c["ok"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
