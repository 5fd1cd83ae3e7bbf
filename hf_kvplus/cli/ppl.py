"""`kvplus ppl`: perplexity of a model on a long text through one or more caches."""

from __future__ import annotations

import math

from ..evaluation.perplexity import MODES, cache_free_nll, perplexity, plot_perplexity
from ..evaluation.report import format_table, stamp
from . import common


def register(subparsers) -> None:
    parser = subparsers.add_parser("ppl", help="perplexity on a long text, chunked or streaming")
    common.add_model_args(parser)
    common.add_cache_args(parser, ["dynamic"])
    parser.add_argument("--tokens", type=int, default=8192, help="score the first N tokens of the text")
    parser.add_argument("--mode", choices=sorted(MODES), default="chunked")
    parser.add_argument("--chunk", type=int, default=None, help="tokens per forward (default: 256 chunked, 1 streaming)")
    parser.add_argument("--segment", type=int, default=1024, help="report perplexity per this many tokens")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="continuation mode: the prompt fed in one forward, before the scored continuation")
    parser.add_argument("--cache-free", action="store_true", help="also score the tokens with one cache-free forward")
    parser.set_defaults(func=run)


def run(args) -> int:
    common.setup(args)
    specs = common.cache_specs(args, ["dynamic"])
    model, tokenizer, text = common.load(args)
    ids = common.scored_tokens(tokenizer, text, args.tokens)
    results = []
    for spec in specs:
        result = perplexity(
            model, ids, lambda spec=spec: spec.build(model.config, max_length=ids.numel()),
            mode=args.mode, chunk_size=args.chunk, segment_size=args.segment, label=spec.text,
            prompt_tokens=args.prompt_tokens,
        )
        results.append(result)
    rows = [r.summary() for r in results]
    base = results[0].perplexity
    for row in rows:
        row["delta_pct"] = 100 * (row["perplexity"] / base - 1)
    if args.mode == "continuation":
        base_cont = results[0].continuation_perplexity
        for row in rows:
            row["continuation_delta_pct"] = 100 * (row["continuation_perplexity"] / base_cont - 1)
    if args.cache_free:
        nll = cache_free_nll(model, ids)
        ppl = math.exp(nll.double().mean().item())
        rows.append({"cache": "cache-free forward", "mode": "one pass", "tokens_scored": nll.numel(),
                     "perplexity": ppl, "delta_pct": 100 * (ppl / base - 1)})
    print(f"\n{args.model} on {args.text}, first {ids.numel()} tokens, {args.mode}")
    print(format_table(rows, [("cache", "cache", ""), ("mode", "mode", ""), ("chunk_size", "chunk", "d"),
                              ("tokens_scored", "tokens", "d"), ("perplexity", "perplexity", ".4f"),
                              ("delta_pct", "delta %", "+.3f"), ("continuation_perplexity", "continuation ppl", ".4f"),
                              ("continuation_delta_pct", "cont. delta %", "+.3f"), ("seconds", "seconds", ".1f")]))
    if len(results) > 1:
        print("\nper segment:")
        segments = [r.segments() for r in results]
        seg_rows = [{"tokens": f"{s['start']}-{s['end']}", **{r.cache: seg[i]["perplexity"] for r, seg in zip(results, segments, strict=True)}}
                    for i, s in enumerate(segments[0])]
        print(format_table(seg_rows, [("tokens", "tokens", "")] + [(r.cache, r.cache, ".3f") for r in results]))
    folder = common.out_dir(args, "ppl")
    for result in results:
        name = result.cache.replace(":", "_").replace("=", "-").replace("/", "_")  # (a spec may name a file)
        result.to_json(folder / f"ppl_{name}.json", stamp())
        result.to_csv(folder / f"ppl_{name}.csv")
    plot_perplexity(results, folder / "ppl.png", title=f"{args.model} on {args.text} ({args.mode})")
    common.write_json(folder / "ppl_summary.json", {"model": args.model, "text": args.text, "rows": rows})
    print(f"\nwrote {folder}/ppl_summary.json, per-token JSON/CSV and ppl.png")
    return 0
