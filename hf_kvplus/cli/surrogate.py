"""`kvplus train-surrogate`: fit KVzap's surrogate (a linear model per layer and KV head that predicts KVzip's score
of a token from its key and value) on KVzip's true scores of some texts, measure how it ranks held-out text, and save
it for `KVzapCache` and the `kvzap:<budget>:weights=PATH` spec."""

from __future__ import annotations

from ..errors import ConfigError
from ..evaluation.report import format_table
from ..evaluation.surrogate_fit import fit_surrogate, ranking_quality
from . import common


def register(subparsers) -> None:
    parser = subparsers.add_parser("train-surrogate", help="fit KVzap's surrogate of KVzip's scores for a model")
    common.add_model_args(parser, text=False)
    parser.add_argument("--texts", nargs="+", default=["austen:persuasion", "austen:emma"],
                        help="texts to fit on (default austen:persuasion austen:emma; not the evaluation's text)")
    parser.add_argument("--holdout", default="austen:northangerabbey",
                        help="text to measure the ranking on (default austen:northangerabbey)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096],
                        help="chunk lengths, each taken --chunks times per text (default 2048 4096)")
    parser.add_argument("--chunks", type=int, default=2, help="chunks of each length per text, spread over it")
    parser.add_argument("--ridge", type=float, default=1e-3, help="ridge, times the mean feature energy")
    parser.set_defaults(func=run)


def spread_chunks(ids, tokens: list[int], chunks: int) -> list:
    """`chunks` chunks `[1, n]` of each length in `tokens`, at offsets spread evenly over `ids` (1-d)."""
    out = []
    for n in tokens:
        if ids.numel() < n:
            raise ConfigError(f"a chunk of {n} tokens does not fit in a text of {ids.numel()} tokens")
        out += [ids[None, start : start + n] for start in
                (round(i * (ids.numel() - n) / max(1, chunks - 1)) if chunks > 1 else 0 for i in range(chunks))]  # fmt: skip
    return out


def run(args) -> int:
    from ..resolve import load_model, load_text

    common.setup(args)
    if args.chunks < 1 or any(n < 16 for n in args.tokens):
        raise ConfigError(f"--chunks must be >= 1 and --tokens >= 16 each, got {args.chunks} and {args.tokens}")
    model, tokenizer = load_model(args.model)
    chunks = [c for text in args.texts
              for c in spread_chunks(common.tokenize(tokenizer, load_text(text), 10**9), args.tokens, args.chunks)]  # fmt: skip
    held_out = spread_chunks(common.tokenize(tokenizer, load_text(args.holdout), 10**9), args.tokens, 1)
    surrogate = fit_surrogate(model, tokenizer, chunks, name=args.model, ridge=args.ridge,
                              measured={"texts": args.texts, "tokens_per_chunk": args.tokens})  # fmt: skip
    quality = ranking_quality(surrogate, model, tokenizer, held_out)
    surrogate.measured.update({"holdout": args.holdout, **quality})
    print(format_table([quality], [("spearman", "Spearman", ".3f"), ("recall", f"top-{quality['keep']:.0%} recall", ".3f"),
                                   ("worst_layer_spearman", "worst layer's Spearman", ".3f"),
                                   ("worst_layer_recall", "worst layer's recall", ".3f")]))  # fmt: skip
    folder = common.out_dir(args, "train-surrogate")
    path = surrogate.save(folder / "surrogate.safetensors")
    common.write_json(folder / "surrogate.json", surrogate.measured)
    print(f"wrote {path} (use it: --cache 'kvzap:20%:weights={path}' or KVzapCache(config, '{path}'))")
    return 0
