"""`kvplus needle`: pass-key and RULER-style retrieval in a haystack of real text, over tasks x context lengths x
depths, per cache; accuracy against bytes at rest read off each cache."""

from __future__ import annotations

from ..evaluation.needle import MODES, expand_specs, needle_grid, plot_accuracy_bytes, plot_needle
from ..evaluation.report import format_table, stamp
from ..evaluation.retrieval_tasks import TASKS, retrieval_task
from . import common

DEFAULT_CACHES = ["dynamic", "quantized:int4", "sink:4:508", "h2o:512"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("needle", help="needle in a haystack: pass-key retrieval by length and depth")
    common.add_model_args(parser)
    common.add_cache_args(parser, DEFAULT_CACHES)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048], help="prompt lengths in tokens")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                        help="where the needle sits, as fractions of the haystack")  # fmt: skip
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=["passkey"],
                        help="retrieval tasks (RULER-style; see hf_kvplus.evaluation.retrieval_tasks)")  # fmt: skip
    parser.add_argument("--trials", type=int, default=1, help="prompts per (task, length, depth) cell")
    parser.add_argument("--new-tokens", type=int, default=None, help="answer tokens generated (default: the task's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    parser.add_argument("--mode", choices=MODES, default="aware",
                        help="aware: the whole prompt in one forward; agnostic: the context compressed before the "
                             "question, which is appended with eviction paused (kvpress's pipeline)")  # fmt: skip
    parser.add_argument("--keep", type=float, nargs="+", default=[],
                        help="shares of each prompt's context kept by specs with a {budget} placeholder, e.g. "
                             "--cache 'snapkv:{budget}' --keep 0.1 0.2 0.5")  # fmt: skip
    parser.set_defaults(func=run)


def run(args) -> int:
    common.setup(args)
    specs = expand_specs(args.caches or DEFAULT_CACHES, args.keep)
    model, tokenizer, text = common.load(args)
    haystack = common.tokenize(tokenizer, text, max(args.lengths))
    result = needle_grid(model, tokenizer, haystack, specs, args.lengths, args.depths, trials=args.trials,
                         new_tokens=args.new_tokens, seed=args.seed, tasks=[retrieval_task(t) for t in args.tasks],
                         mode=args.mode)  # fmt: skip
    rows = result.summary()
    columns = [("cache", "cache", ""), ("family", "family", ""), ("accuracy", "accuracy", ".0%")]
    columns += [(f"acc_{n}", f"at {n}", ".0%") for n in args.lengths]
    if len(args.tasks) > 1:
        columns += [(f"acc_{task}", task, ".0%") for task in args.tasks]
    columns += [(f"frac_{n}", f"x fp16 at {n}", ".3f") for n in args.lengths]
    columns += [("bytes_at_rest", f"bytes at {max(args.lengths)}", ",d"), ("seconds", "seconds", ".0f")]
    print(f"\n{args.model}, haystack {args.text}: {', '.join(args.tasks)} at depths {args.depths}, {args.trials} "
          f"prompt(s) per cell, {args.mode} mode; 'x fp16': bytes held per token seen (payload and metadata, read "
          "off the cache after the answer) over float16 K/V")  # fmt: skip
    print(format_table(rows, columns))
    folder = common.out_dir(args, "needle")
    result.to_json(folder / "needle.json", {**stamp(), "mode": args.mode, "keep": args.keep})
    result.to_csv(folder / "needle.csv")
    plot_needle(result, folder / "needle.png", title=f"{args.model}: {', '.join(args.tasks)} in {args.text}")
    plot_accuracy_bytes(result, folder / "accuracy_bytes.png",
                        title=f"{args.model}: {', '.join(args.tasks)} in {args.text}, {args.mode} mode")  # fmt: skip
    print(f"\nwrote {folder}/needle.json, needle.csv, needle.png, accuracy_bytes.png")
    return 0
