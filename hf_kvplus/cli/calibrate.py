"""`kvplus calibrate`: choose, for one model and format, the layers held at other bits within a bits budget, and save
the choice where `QuantizedCache(calibration="auto")` and the `calibration=auto` spec option find it
(`fitted.user_dir(config, "calibration/<bits>")`, in the user cache folder), or into `--out` (`calibration=PATH`).
`--check PCT` calibrates nothing: it measures the format as it ships on the model and text given, against
DynamicCache (`evaluation.format_check.check_format`; `kvplus check-formats` checks several), and exits 1 where its
perplexity change is over PCT."""

from __future__ import annotations

import time

import torch

from ..calibration import Calibration
from ..evaluation.calibrate import calibrate
from ..evaluation.format_check import check_format
from ..evaluation.report import format_table
from ..fitted import user_dir
from ..formats import parse_bits
from . import common


def register(subparsers) -> None:
    parser = subparsers.add_parser("calibrate", help="per-layer bits for a quantized format, within a bits budget")
    common.add_model_args(parser)
    parser.add_argument("--bits", default="k4v2", help="the cache's format (default k4v2)")
    parser.add_argument("--up", nargs="+", default=["k4v3"], help="candidate formats for single layers (default k4v3)")
    parser.add_argument("--down", nargs="+", default=[], help="formats with fewer bits, for the layers they cost least")
    parser.add_argument("--max-bits", type=float, default=3.5, help="bits per coordinate budget (default 3.5)")
    parser.add_argument("--budget-tokens", type=int, default=None,
                        help="count the budget's bits at this many tokens (default: --tokens)")
    parser.add_argument("--reuse", nargs="+", default=[], metavar="JSON",
                        help="calibrations measured the same way: their options are not measured again")
    parser.add_argument("--tokens", type=int, default=2048, help="measure on the first N tokens of the text")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward (default 256)")
    parser.add_argument("--window", type=int, default=128, help="full-precision recent tokens (default 128)")
    parser.add_argument("--first", type=int, default=None, help="exact first tokens (default: the format's preset)")
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="rotation seeds: each option measured at each, divergences averaged (default 0)")
    parser.add_argument("--rotations", type=int, default=1, metavar="N",
                        help="then try N rotation seeds (its own included) on each full-attention layer in a rotated "
                             "format and keep the one of least divergence (default 1: each layer's own)")
    parser.add_argument("--check", type=float, default=None, metavar="PCT",
                        help="calibrate nothing: measure --bits as it ships (seed --seed's first, chunks of --chunk) "
                             "against DynamicCache on --tokens of --text; exit 1 if its perplexity change is over PCT")
    parser.set_defaults(func=run)


def run(args) -> int:
    common.setup(args)
    model, tokenizer, text = common.load(args)
    start = time.perf_counter()
    ids = common.scored_tokens(tokenizer, text, args.tokens)
    if args.check is not None:
        checked = check_format(model, ids, args.bits, threshold_pct=args.check, chunk_size=args.chunk,
                               window=args.window, first_tokens=args.first, rotation_seed=args.seed[0])
        print(checked.message())
        return 1 if checked.over else 0
    calibration, options = calibrate(
        model, ids, model_name=args.model, bits=args.bits, candidates=[*args.up, *args.down],
        max_bits=args.max_bits, chunk_size=args.chunk, window=args.window, first_tokens=args.first,
        rotation_seed=args.seed, budget_tokens=args.budget_tokens, reuse=[Calibration.load(p) for p in args.reuse],
        text=args.text, rotations=args.rotations,
    )  # fmt: skip
    rows = [{"layer": o.layer, "bits": o.bits, "delta_pct": o.delta_pct, "kl": 1e3 * o.kl, "gain": 1e3 * o.gain,
             "added": o.added_bits, "per_bit": 1e3 * o.gain_per_bit,
             "chosen": "yes" if calibration.layer_bits.get(o.layer) == o.bits else ""}
            for o in sorted(options, key=lambda o: (o.layer, o.added_bits))]  # fmt: skip
    print(format_table(rows, [("layer", "layer", "d"), ("bits", "bits", ""), ("delta_pct", "ppl delta %", "+.3f"),
                              ("kl", "KL, mnat/token", ".3f"), ("gain", "KL removed", "+.3f"),
                              ("added", "added bits", ".3f"), ("per_bit", "removed per bit", "+.2f"),
                              ("chosen", "chosen", "")]))  # fmt: skip
    measured = calibration.measured
    if measured.get("rotation_kl"):
        rows = [{"layer": int(index), "seed": seed, "kl": 1e3 * kl,
                 "chosen": "yes" if calibration.layer_rotations.get(int(index), "own") == (
                     seed if seed == "own" else int(seed)) else ""}
                for index, kls in measured["rotation_kl"].items() for seed, kl in kls.items()]  # fmt: skip
        print("\n" + format_table(rows, [("layer", "layer", "d"), ("seed", "rotation seed", ""),
                                         ("kl", "KL, mnat/token", ".3f"), ("chosen", "chosen", "")]))  # fmt: skip
    print(f"\n{args.bits}: {measured['base_delta_pct']:+.3f}% perplexity, KL {1e3 * measured['base_kl']:.3f} mnat/token "
          f"at {measured['base_bits']:.3f} bits; calibrated ({len(calibration.layer_bits)} layers changed): "
          f"{measured['calibrated_delta_pct']:+.3f}%, KL {1e3 * measured['calibrated_kl']:.3f} at "
          f"{calibration.bits_per_coordinate:.3f} bits (budget {args.max_bits}; bits at "
          f"{measured['budget_tokens']} tokens)")  # fmt: skip
    calibration.measured.update({"threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - start, 1)})
    folder = args.out or user_dir(model.config, f"calibration/{parse_bits(args.bits)}")
    folder.mkdir(parents=True, exist_ok=True)
    _plot(options, calibration, folder / "calibration.png", f"{args.model}, {args.bits}, on {args.text}")
    path = calibration.save(folder / ".calibration.json.tmp").replace(folder / "calibration.json")
    use = "auto" if args.out is None else path
    print(f"wrote {path} (use it: --cache quantized:{args.bits}:calibration={use}) and calibration.png")
    return 0


def _plot(options, calibration, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for candidate in sorted({o.bits for o in options}):
        mine = [o for o in options if o.bits == candidate]
        colours = ["tab:green" if calibration.layer_bits.get(o.layer) == candidate else "tab:gray" for o in mine]
        ax.bar([o.layer for o in mine], [1e3 * o.gain for o in mine], color=colours, label=f"one layer at {candidate}")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("KL from full precision removed (mnat/token)")
    ax.set_title(f"{title}: green = chosen")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
