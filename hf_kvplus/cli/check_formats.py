"""`kvplus check-formats`: what the low-bit presets (or any lossy caches) cost the model at hand on the user's own
text, against DynamicCache, with a verdict per spec against a threshold (`evaluation.format_check.check_formats`).
A report, not a test: it exits 0 whatever the verdicts, 3 with `--fail-over` where a spec is over the threshold."""

from __future__ import annotations

from pathlib import Path

from ..evaluation.format_check import DEFAULT_SPECS, check_formats
from . import common

#: The exit status of `--fail-over` when a spec is over the threshold (2 is a refused input).
OVER = 3


def register(subparsers) -> None:
    parser = subparsers.add_parser("check-formats", help="what the low-bit presets cost your model on your text")
    parser.add_argument("--model", default=common.DEFAULT_MODEL,
                        help="built-in name (smollm2-135m, gemma3-270m), local folder or hub id")
    parser.add_argument("--text", required=True,
                        help="your text: a local file (or austen:<book>, hf:<dataset>[:config][:split])")
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS), metavar="SPEC",
                        help=f"lossy cache specs (default: {' '.join(DEFAULT_SPECS)}, as they ship for the model)")
    parser.add_argument("--threshold", type=float, default=1.0, metavar="PCT",
                        help="perplexity change (%%) over which a spec is flagged (default 1.0)")
    parser.add_argument("--tokens", type=int, default=1024, help="measure on the first N tokens of the text")
    parser.add_argument("--chunk", type=int, default=32, help="tokens per forward (default 32)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the check as JSON")
    parser.add_argument("--fail-over", action="store_true", help=f"exit {OVER} if a spec is over the threshold")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.set_defaults(func=run)


def run(args) -> int:
    common.setup(args)
    model, tokenizer, text = common.load(args)
    ids = common.tokenize(tokenizer, text, args.tokens)  # (too short a text: check_formats names both counts)
    check = check_formats(model, ids, args.specs, threshold_pct=args.threshold, tokens=args.tokens,
                          chunk_size=args.chunk, model_name=args.model)  # fmt: skip
    print(check.to_markdown())
    advice = check.advice()
    print("\n" + "\n".join(advice or [f"every spec is within the {args.threshold:g}% threshold"]))
    if args.json is not None:
        common.write_json(args.json, {"text": args.text, **check.to_dict()})
        print(f"wrote {args.json}")
    return OVER if args.fail_over and advice else 0
