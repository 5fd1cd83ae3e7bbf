"""`kvplus train-surrogate`: fit KVzap's surrogate (a linear model per layer and KV head that predicts KVzip's score
of a token from its key and value) on KVzip's true scores of some texts, measure how it ranks held-out text, and save
it where `KVzapCache(config)` and the `kvzap:20%` spec find it (`fitted.user_dir(config, "kvzap")`, in the user cache
folder) or into `--out`. The defaults are what the shipped Gemma 3 270M surrogate was fitted with (SmolLM2-135M's:
the same with `--tokens 2048 4096`)."""

from __future__ import annotations

import time

import torch

from ..errors import ConfigError
from ..evaluation.report import format_table
from ..evaluation.surrogate_fit import fit_surrogate, ranking_quality, with_numbers
from ..fitted import user_dir
from . import common


def register(subparsers) -> None:
    parser = subparsers.add_parser("train-surrogate", help="fit KVzap's surrogate of KVzip's scores for a model")
    common.add_model_args(parser, text=False)
    parser.add_argument("--texts", nargs="+", default=["austen:persuasion", "austen:emma", "austen:mansfieldpark"],
                        help="texts to fit on (default austen:persuasion austen:emma austen:mansfieldpark; not the "
                             "evaluation's text)")
    parser.add_argument("--holdout", default="austen:northangerabbey",
                        help="text to measure the ranking on (default austen:northangerabbey)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048],
                        help="chunk lengths, each taken --chunks times per text (default 2048)")
    parser.add_argument("--chunks", type=int, default=1, help="chunks of each length per text, spread over it")
    parser.add_argument("--ridge", type=float, default=1e-2, help="ridge, times the mean feature energy")
    parser.add_argument("--numbers", type=int, default=100,
                        help="each text also gives a chunk of the first --tokens length with a random five-digit "
                             "number every ~N tokens (default 100; 0: none): Austen has almost no numbers")
    parser.set_defaults(func=run)


def spread_chunks(ids, tokens: list[int], chunks: int) -> list:
    """`chunks` chunks `[1, n]` of each length n in `tokens`, all at starts spread evenly over `ids` (1-d)."""
    lengths = [n for n in tokens for _ in range(chunks)]
    if ids.numel() < max(lengths):
        raise ConfigError(f"a chunk of {max(lengths)} tokens does not fit in a text of {ids.numel()} tokens")
    room, count = ids.numel() - max(lengths), max(1, len(lengths) - 1)
    return [ids[None, round(k * room / count) : round(k * room / count) + n] for k, n in enumerate(lengths)]


def run(args) -> int:
    from ..resolve import load_model, load_text

    common.setup(args)
    if args.chunks < 1 or any(n < 16 for n in args.tokens):
        raise ConfigError(f"--chunks must be >= 1 and --tokens >= 16 each, got {args.chunks} and {args.tokens}")
    model, tokenizer = load_model(args.model)
    start = time.perf_counter()
    chunks = []
    for seed, text in enumerate(args.texts):
        ids = common.tokenize(tokenizer, load_text(text), 10**9)
        chunks += spread_chunks(ids, args.tokens, args.chunks)
        if args.numbers:  # (from the text's middle, apart from the plain chunks' starts)
            middle = ids[ids.numel() // 2 :].tolist()
            chunks.append(with_numbers(middle, args.tokens[0], args.numbers, tokenizer, seed))
    held_out = spread_chunks(common.tokenize(tokenizer, load_text(args.holdout), 10**9), args.tokens, 1)
    surrogate = fit_surrogate(model, tokenizer, chunks, name=args.model, ridge=args.ridge,
                              measured={"texts": args.texts, "tokens_per_chunk": args.tokens,
                                        "numbers_every": args.numbers})  # fmt: skip
    quality = ranking_quality(surrogate, model, tokenizer, held_out)
    surrogate.measured.update({"holdout": args.holdout, **quality, "threads": torch.get_num_threads(),
                               "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
    print(format_table([quality], [("spearman", "Spearman", ".3f"), ("recall", f"top-{quality['keep']:.0%} recall", ".3f"),
                                   ("worst_layer_spearman", "worst layer's Spearman", ".3f"),
                                   ("worst_layer_recall", "worst layer's recall", ".3f")]))  # fmt: skip
    folder = args.out or user_dir(model.config, "kvzap")
    folder.mkdir(parents=True, exist_ok=True)
    common.write_json(folder / "surrogate.json", surrogate.measured)
    path = surrogate.save(folder / ".surrogate.safetensors.tmp").replace(folder / "surrogate.safetensors")
    if args.out is None:
        print(f"wrote {path}: KVzapCache(model.config, budget=0.2) and --cache kvzap:20% use it for this model")
    else:
        print(f"wrote {path} (use it: --cache 'kvzap:20%:weights={path}' or KVzapCache(config, '{path}'))")
    return 0
