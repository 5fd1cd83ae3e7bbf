"""Compiled decode: every compileable cache against StaticCache compiled the same way, in one run.

    python eval/bench_compile.py --out eval/results/compile_cpu
    python eval/bench_compile.py --out /tmp/c --contexts 256 --new 8 16 --repeats 1 --backend eager   # quick look
    python eval/bench_compile.py --out DIR --device cuda --mode reduce-overhead   # GPU: CUDA graphs
    python eval/bench_compile.py --out DIR --gpu-pass [--dry-run]   # the GPU pass's step (see below)

`generate()` compiles the decode forward of a cache that declares `is_compileable` (StaticCache, and
DenseCache / PagedCache / QuantizedCache / SinkCache / H2OCache built with `compile=on`; the dense, paged and
quantized ones sized like StaticCache): the mask is built outside the graph, and each decode step
calls the compiled forward. This times that, per context length, on the tiny 8-layer Llama of
`bench_host.py`:

- decode ms per token: inside one `generate()` of `--new` N2 tokens, the time from token N1 to token N2
  (stamped by a stopping criterion that never stops) divided by N2 - N1, so neither the prefill nor its
  run-to-run noise enters (a difference of two generate() calls did: at 8K the prefill's noise came to
  several ms per token); after a warm-up that compiles every shape, median over `--repeats` runs; each
  cache is compiled and timed on its own, after `torch._dynamo.reset()` (one process, one cache, as users
  run it);
- its ratio to StaticCache compiled the same way (`max_cache_len` = prompt + N2, so it attends over the
  whole buffer, masked, as StaticCache does). With `--paired`, StaticCache is compiled beside each cache
  (after the reset, the two graphs in one compiled forward) and the two are timed alternately, `--repeats`
  pairs: the ratio is the median of the pairs' ratios, StaticCache's time the median over all pairs. On a
  machine whose step time drifts by up to 2x over minutes (the 2-core VM), separate stretches give ratios
  from 0.8 to 1.9 for one cache; pairs taken seconds apart agree within about 0.1;
- DynamicCache and a SinkCache without `compile=on`, which generate() runs eagerly, as references.

`--model tiny-hd128` is the tiny model with a real model's heads: 128 channels, 8 query heads on 2 KV heads
(hidden 1024), where the tiny model's heads have 32 channels and a group of 2. `--model llama-8b` builds Llama
3.1 8B's shape with random bfloat16 weights (`--layers` of them; the ratios are per-layer work, so fewer layers
keep a GPU call short). `--batch` runs each context at those batch
sizes, every row a distinct prompt. `--gpu-pass` is the GPU pass's `compile` step (`scripts/gpu_pass.sh`):
the 8B shape on CUDA with CUDA graphs (`reduce-overhead`), 4K and 32K tokens, batch 1 and 8, StaticCache
against every static cache here; with `--dry-run` the same code at tiny sizes on the CPU (eager backend).

Each row also says what the cache's calls compiled: the graphs dynamo compiled (a cache whose decode step takes
no int and writes only static inputs compiles one) and the graphs inductor declined to capture as CUDA graphs
under `reduce-overhead` ("CUDA-graph skips": mutated inputs not at static addresses, CPU tensors; 0 for a captured
decode, and always 0 on the CPU).

Writes `compile.json`, `compile.md` and `compile.png` into `--out`.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from bench_host import TINY, build_model
from gpu_common import LLAMA_31_8B
from torch._dynamo.utils import counters
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    CompileConfig,
    LlamaConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from hf_kvplus import cache_kwargs

#: The GPU pass's step: every static cache against StaticCache, the evicting ones at an eighth of 32K. Inductor's
#: graph partition is off: torch 2.11 generated a partition naming a size symbol it was not passed (NameError
#: 's85') for the paged cache's store.
GPU_PASS = dict(
    model="llama-8b", layers=4, device="cuda", mode="reduce-overhead", contexts=[4096, 32768], batch=[1, 8],
    new=[8, 40], repeats=1, graph_partition="off",
    specs=["static", "dense:compile=on", "paged:compile=on", "quantized:int4:compile=on", "sink:4:4092:compile=on",
           "h2o:4096:compile=on"],
)  # fmt: skip
#: The same at tiny sizes on the CPU (a check of the script, not a measurement): two layers (a first and a later
#: one) and the fewest tokens that still time two decode steps after a warm-up call that compiled every shape.
#: Four layers and tokens 4 to 10 took this step from 38 s to 81 s on the 2-core VM and checked nothing more.
DRY_RUN = dict(device="cpu", backend="eager", mode=None, contexts=[48], new=[2, 4], layers=2)
#: `--model tiny-hd128`: the tiny model's 8 layers with a real model's heads (128 channels, 4 query heads to a KV head).
TINY_HD128 = dict(hidden_size=1024, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
#: A tiny stand-in for the 8B shape in dry runs.
TINY_8B = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
SPECS = [
    "static", "dynamic", "dense:compile=on", "paged:compile=on", "quantized:int4:compile=on", "sink:4:1020",
    "sink:4:1020:compile=on", "h2o:1024:compile=on",
]  # fmt: skip
COLUMNS = [
    ("context", "context", "d"),
    ("batch", "batch", "d"),
    ("cache", "cache", ""),
    ("compiled", "compiled", ""),
    ("decode_ms", "decode ms/token", ".3f"),
    ("vs_static", "x StaticCache", ".2f"),
    ("graphs", "graphs compiled", "d"),
    ("cudagraph_skips", "CUDA-graph skips", "d"),
]


class StepClock(StoppingCriteria):
    """Never stops generation; stamps the time each new token is done (after a device sync on CUDA)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def compile_counts() -> Counter:
    """Graphs dynamo has compiled, and graphs inductor declined to capture as CUDA graphs, so far."""
    return Counter(graphs=counters["stats"]["unique_graphs"], cudagraph_skips=counters["inductor"]["cudagraph_skips"])


def counted_seconds(counts: Counter, spec, model, prompt, new, max_length, config) -> float:
    """`decode_seconds`, adding what its call compiled to `counts`."""
    before = compile_counts()
    seconds = decode_seconds(model, spec, prompt, new, max_length, config)
    counts.update(compile_counts() - before)
    return seconds


def decode_seconds(model, spec, prompt, new: tuple[int, int], max_length, config) -> float:
    """Seconds per token from token N1 to token N2 of one `generate()`: the prefill is outside the span."""
    n1, n2 = new
    cache = spec.build(model.config, max_length=max_length)
    clock = StepClock()
    model.generate(prompt, **cache_kwargs(cache), max_new_tokens=n2, min_new_tokens=n2, do_sample=False,
                   compile_config=config, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))  # fmt: skip
    return (clock.stamps[n2 - 1] - clock.stamps[n1 - 1]) / (n2 - n1)


def markdown(result: dict) -> str:
    from hf_kvplus.evaluation.report import format_table

    a = result["args"]
    if a["model"] == "llama-8b":
        model = f"Llama-3.1-8B-shaped ({a['layers']} layers), random weights, {a['dtype']}"
    else:
        shape = {**TINY, **(TINY_HD128 if a["model"] == "tiny-hd128" else {})}
        heads = f"{shape['num_attention_heads']} query heads on {shape['num_key_value_heads']} KV heads"
        model = (f"tiny Llama ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, {heads} of "
                 f"{shape['hidden_size'] // shape['num_attention_heads']} channels), float32")  # fmt: skip
    return "\n".join([
        "## Compiled decode against StaticCache" + (" (dry run: tiny sizes on the CPU)" if a["dry_run"] else ""),
        "",
        f"{model}, {a['device']}, "
        f"backend {a['backend']}, mode {a['mode']}"
        + (f", graph partition {a['graph_partition']}" if a.get("graph_partition", "default") != "default" else "")
        + f", {a['threads']} thread(s); decode time from generate() of "
        f"tokens {a['new'][0]} to {a['new'][1]} of one call, median of {a['repeats']}"
        + (" pairs with StaticCache, timed alternately" if a.get("paired") == "True" else "")
        + f"; {result['machine']}, {result['date']}",
        "",
        "```",
        format_table([{**row, "compiled": short_error(row["compiled"])} for row in result["rows"]], COLUMNS),
        "```",
        "",
        *(["Failed:", "", *(f"- {line[:400]}" for line in result["failed"]), ""] if result.get("failed") else []),
    ])  # fmt: skip


def short_error(compiled: str) -> str:
    """The table's "compiled" cell: yes, no (eager), or a failure's error type (its message follows the table)."""
    return compiled if compiled in ("yes", "no (eager)") else f"failed: {compiled.split(':')[0]}"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["context"], r["batch"]) for r in rows})
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(caches)
    for i, cache in enumerate(caches):
        ratio = {(r["context"], r["batch"]): r["vs_static"] for r in rows if r["cache"] == cache}
        ratios = [ratio.get(g, math.nan) for g in groups]
        axis.bar([k + i * width for k in range(len(groups))], ratios, width, label=cache)
    axis.axhline(1.0, color="black", linewidth=0.8)
    labels = [f"{c} tokens" + (f", batch {b}" if len({g[1] for g in groups}) > 1 else "") for c, b in groups]
    axis.set_xticks([k + 0.4 - width / 2 for k in range(len(groups))], labels)
    axis.set_ylabel("decode time per token, x StaticCache compiled")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for compile.json, compile.md and compile.png")
    parser.add_argument("--specs", nargs="+", default=SPECS, help="cache specs; static must be among them")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192], help="prompt lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (distinct prompts per row)")
    parser.add_argument("--new", type=int, nargs=2, default=[8, 72], metavar=("N1", "N2"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paired", action="store_true", help="time StaticCache beside each cache, alternately")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", default=None, help="torch.compile mode (reduce-overhead: CUDA graphs)")
    parser.add_argument("--graph-partition", choices=["default", "on", "off"], default="default",
                        help="inductor's graph partition (torch._inductor.config.graph_partition)")  # fmt: skip
    parser.add_argument("--model", choices=["tiny", "tiny-hd128", "llama-8b"], default="tiny")
    parser.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model")
    parser.add_argument("--gpu-pass", action="store_true",
                        help="the GPU pass's step (its sizes and specs; options given beside it replace theirs)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks the script")
    if parser.parse_known_args(argv)[0].gpu_pass:  # its values as defaults, so that options given replace them
        parser.set_defaults(**GPU_PASS)  # (a share of the step, such as one batch size: `--gpu-pass --batch 1`)
    args = parser.parse_args(argv)
    if args.dry_run:
        vars(args).update(DRY_RUN)
    if "static" not in args.specs:
        parser.error("the specs must include static, the baseline")
    args.dtype = "bfloat16" if args.model == "llama-8b" and not args.dry_run else "float32"
    return args


def model_for(args):
    if args.model.startswith("tiny"):
        return build_model(**(TINY_HD128 if args.model == "tiny-hd128" else {})).to(args.device)
    shape = {**LLAMA_31_8B, "num_hidden_layers": args.layers, **(TINY_8B if args.dry_run else {})}
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=getattr(torch, args.dtype),
                                                 attn_implementation="sdpa")  # fmt: skip
    return model.eval()


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # one graph set per context length and cache
    if args.graph_partition != "default":
        import torch._inductor.config as inductor

        inductor.graph_partition = args.graph_partition == "on"
    from hf_kvplus.specs import parse_cache_spec

    config = CompileConfig(backend=args.backend, mode=args.mode, fullgraph=True)
    config._compile_all_devices = True  # generate() compiles on CUDA only, unless told
    model = model_for(args)
    specs = [parse_cache_spec(s) for s in args.specs]
    n1, n2 = args.new
    rows, failed = [], []
    for batch in args.batch:  # batch outer: a run cut at its limit has every context at the first batch size
        for context in args.contexts:
            generator = torch.Generator().manual_seed(context * 100 + batch)
            prompt = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator).to(args.device)
            times = {spec.text: [] for spec in specs}
            ratios = {spec.text: [] for spec in specs}
            counted = {}  # per cache, what its calls compiled (StaticCache, paired: beside the last cache)
            errors = {}
            static = next(spec for spec in specs if spec.text == "static")
            timed = [spec for spec in specs if spec is not static] if args.paired else specs
            for spec in tqdm(timed, desc=f"{context} tokens, batch {batch}", file=sys.stderr):
                # Each cache compiles alone (or beside StaticCache, paired), as in a process that uses one cache:
                # graphs of several caches under one compiled forward share its automatic-dynamic state, and
                # inductor (torch 2.13, CPU) then generated code naming an unbound size symbol for H2O's graph
                # after SinkCache's (NameError at run time).
                torch._dynamo.reset()
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                pair = (static, spec) if args.paired else (spec,)
                counts = {s.text: Counter() for s in pair}
                run = (model, prompt, (n1, n2), context + n2, config)
                try:
                    for s in pair:  # compiles every shape of the run
                        counted_seconds(counts[s.text], s, *run)
                    for _ in range(args.repeats):
                        took = [counted_seconds(counts[s.text], s, *run) for s in pair]
                        for s, seconds in zip(pair, took, strict=True):
                            times[s.text].append(seconds)
                        ratios[spec.text].append(took[-1] / took[0])
                except Exception as error:  # a first run on a new device: report it, time the other caches
                    traceback.print_exc()
                    errors[spec.text] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                    failed.append(f"{context} tokens, batch {batch}, {spec.text}: {errors[spec.text]}")
                counted.update(counts)
                done = [s for s in specs if s.text in counted or s.text in errors]
                # after each cache: a run cut short keeps what it measured (an H2O run at 32K x 8 once ran past the
                # step's limit, and the four caches timed before it were lost with the group)
                write(args, rows + group_rows(args, model, done, context, batch, times, ratios, errors, counted), failed)
            rows += group_rows(args, model, specs, context, batch, times, ratios, errors, counted)
            write(args, rows, failed)
    print(markdown(json.loads((args.out / "compile.json").read_text())))
    if failed:
        sys.exit(f"{len(failed)} cache(s) failed:\n" + "\n".join(failed))


def group_rows(args, model, specs, context, batch, times, ratios, errors, counted) -> list[dict]:
    """The table's rows of one context and batch; a cache that failed has its error for `compiled`. `counted`: per
    cache, the graphs its runs compiled and the CUDA-graph captures inductor skipped (a cache whose decode is
    captured compiles one graph and skips none)."""
    n2 = args.new[1]
    base = statistics.median(times["static"]) if times["static"] else math.nan
    group = []
    for spec in specs:
        if spec.text in errors or not times[spec.text]:
            compiled, seconds, ratio = errors.get(spec.text, "not timed (StaticCache failed)"), math.nan, math.nan
        else:
            compiled = "yes" if spec.build(model.config, max_length=context + n2).is_compileable else "no (eager)"
            seconds = statistics.median(times[spec.text])
            paired = args.paired and spec.text != "static"
            ratio = statistics.median(ratios[spec.text]) if paired else seconds / base
        counts = counted.get(spec.text)  # (a Counter: 0 where nothing was counted)
        group.append({"context": context, "batch": batch, "cache": spec.text, "compiled": compiled,
                      "decode_ms": seconds * 1e3, "vs_static": ratio,
                      "graphs": None if counts is None else counts["graphs"],
                      "cudagraph_skips": None if counts is None else counts["cudagraph_skips"]})  # fmt: skip
    return group


def write(args, rows: list[dict], failed: list[str]) -> None:
    """compile.json, compile.md and compile.png of the rows so far."""
    from hf_kvplus.evaluation.report import stamp

    result = {**stamp(), "args": {**{k: str(v) for k, v in vars(args).items()}, "new": args.new,
                                  "dry_run": args.dry_run}, "rows": rows, "failed": failed}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile.json").write_text(json.dumps(result, indent=2))
    (args.out / "compile.md").write_text(markdown(result))
    plot([r for r in rows if not math.isnan(r["vs_static"])], args.out / "compile.png")


if __name__ == "__main__":
    main()
