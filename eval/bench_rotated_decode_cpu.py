"""Time of one call of the rotated formats' C++ decode operator (`hf_kvplus_cpu::rotated_decode`), per layer, on
the CPU: keys with no centre, a fixed centre and a turning centre (kernels/turning_center.py), at model shapes.

The inputs are made as a `QuantizedCache(bits="k4v2")` makes them: keys around a common mean before RoPE, coded with
`quantize_rotated` (relative to the centre, at their indices for a turning one), values coded, a full-precision
window of `--window` tokens after the codes, q of one decode step, no mask; the operator's arguments are those
`rotated_cpu.rotated_decode_cpu` passes (checked once against it). Each variant is timed `--repeats` times in
alternation (a repeat: `--calls` calls; the calling thread's CPU time unless `--wall`), and the table shows the
median time per call and each centre's time as a ratio of no centre's. With `--against REV` the operator's source at git revision REV is built too, under another
name, and timed in the same alternation (the ratio new / REV per row).

    python eval/bench_rotated_decode_cpu.py --tokens 4096 16384 --against fb6e0a3
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from pathlib import Path

import torch

from hf_kvplus.kernels import rotated_cpu
from hf_kvplus.kernels.quant_format import PackedKV
from hf_kvplus.kernels.rotated_format import KeyCenter, RotatedFormat, quantize_rotated
from hf_kvplus.kernels.turning_center import RotaryBasis

#: (KV heads, queries per KV head, head dim, RoPE theta) of the models' attention layers.
SHAPES = {
    "smollm2-135m": (3, 3, 64, 100_000.0),
    "gemma3-270m": (1, 4, 256, 1_000_000.0),
}
CENTRES = ("none", "fixed", "turning")
ROOT = Path(__file__).resolve().parent.parent


def make_args(shape: str, tokens: int, centre: str, bits: str, window: int, seed: int = 0) -> tuple:
    """The operator's arguments for one decode step over `tokens` codes and a window of `window` exact tokens."""
    Hkv, G, D, theta = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    fmt = RotatedFormat(int(bits[1]), int(bits[3]), seed=3)
    rope = RotaryBasis(1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D), D)
    origin = 4  # keys after RoPE at positions origin + index, around a common mean before it
    before = torch.randn(1, Hkv, tokens, D, generator=g) + 2 * torch.randn(Hkv, 1, D, generator=g)
    keys = rope.unturned(before, -(torch.arange(tokens) + origin))
    values = torch.randn(1, Hkv, tokens, D, generator=g)
    positions = torch.arange(tokens)
    center = None
    if centre == "fixed":
        center = KeyCenter()
    elif centre == "turning":
        center = KeyCenter(rope, origin)
    kc, kn = quantize_rotated(keys, fmt, "keys", positions if centre == "turning" else None, center)
    vc, vn = quantize_rotated(values, fmt, "values")
    tables = rotated_cpu._decoder(fmt, D, D, torch.device("cpu"))
    q = torch.randn(1, Hkv * G, D, generator=g)
    ring_k, ring_v = torch.randn(1, Hkv, window, D, generator=g), torch.randn(1, Hkv, window, D, generator=g)
    turn = center.block_basis(0, tokens, torch.device("cpu")) if centre == "turning" else (None, None)
    args = (q, kc, kn, vc, vn, *tables, center.rotated if centre == "fixed" else None,
            center.weights if centre == "turning" else None, *turn, ring_k, ring_v, False, None, D**-0.5,
            False)  # fmt: skip
    want, _ = rotated_cpu.rotated_decode_cpu(q, PackedKV(kc, kn, None, vc, vn, None), fmt, 0, tokens, D**-0.5, ring_k,
                                             ring_v, None, False, center)  # fmt: skip
    got, _ = torch.ops.hf_kvplus_cpu.rotated_decode(*args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    return args


def build_against(rev: str):
    """The operator at git revision `rev`, built as its own library under the namespace hf_kvplus_cpu_ref."""
    from torch.utils.cpp_extension import load_inline

    sources = []
    for name in ("cpu_common.cpp", "rotated_attention_cpu.cpp"):
        text = subprocess.run(["git", "show", f"{rev}:kernels/{name}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout  # fmt: skip
        sources.append(text.replace("kvplus_cpu", "kvplus_cpu_ref"))  # hf_kvplus_cpu too
    digest = hashlib.sha256("\n".join([*sources, *rotated_cpu._FLAGS]).encode()).hexdigest()[:16]
    load_inline(f"hf_kvplus_cpu_ref_{digest}", cpp_sources=sources, extra_cflags=rotated_cpu._FLAGS,
                extra_ldflags=rotated_cpu._OPENMP, is_python_module=False)  # fmt: skip
    return torch.ops.hf_kvplus_cpu_ref.rotated_decode


def per_call(op, args: tuple, calls: int, clock) -> float:
    start = clock()
    for _ in range(calls):
        op(*args)
    return (clock() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096], help="codes per call (default 4096)")
    parser.add_argument("--bits", default="k4v2", choices=["k4v2", "k3v2"])
    parser.add_argument("--window", type=int, default=128, help="exact tokens after the codes (default 128)")
    parser.add_argument("--repeats", type=int, default=7, help="alternating repeats per variant (default 7)")
    parser.add_argument("--calls", type=int, default=20, help="calls per repeat (default 20)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall-clock time (default: this thread's CPU time, which "
                        "time slices given to other processes on a shared machine do not count in)")
    parser.add_argument("--against", metavar="REV", help="also time the operator's source at git revision REV")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if opts.threads > 1 and not opts.wall:
        raise SystemExit("--threads > 1 needs --wall (the CPU time counted is the calling thread's)")
    clock = time.perf_counter if opts.wall else time.thread_time
    if not rotated_cpu.available():
        raise SystemExit("the C++ CPU operators could not be built")
    ops = {"this": torch.ops.hf_kvplus_cpu.rotated_decode}
    if opts.against:
        ops[opts.against] = build_against(opts.against)
    for shape in opts.shapes:
        for tokens in opts.tokens:
            cases = {c: make_args(shape, tokens, c, opts.bits, opts.window) for c in CENTRES}
            variants = [(name, c) for c in CENTRES for name in ops]
            times = {v: [] for v in variants}
            for name, c in variants:  # warm-up
                per_call(ops[name], cases[c], 2, clock)
            for _ in range(opts.repeats):
                for name, c in variants:
                    times[name, c].append(per_call(ops[name], cases[c], opts.calls, clock))
            med = {v: statistics.median(t) for v, t in times.items()}
            what = "wall-clock" if opts.wall else "CPU"
            print(f"\n{shape} {opts.bits}, {tokens} codes + {opts.window} exact, {opts.threads} thread(s): {what} ms a call")
            head = "".join(f"{name:>12}{'/none':>8}" for name in ops)
            ratio = f"{'this/' + opts.against:>14}" if opts.against else ""
            print(f"{'centre':<10}{head}{ratio}")
            for c in CENTRES:
                row = "".join(f"{1e3 * med[name, c]:12.3f}{med[name, c] / med[name, 'none']:8.2f}" for name in ops)
                if opts.against:
                    row += f"{med['this', c] / med[opts.against, c]:14.2f}"
                print(f"{c:<10}{row}")


if __name__ == "__main__":
    main()
