"""Compiled decode: every compileable cache against StaticCache compiled the same way, in one run.

    python eval/bench_compile.py --out eval/results/compile_cpu
    python eval/bench_compile.py --out /tmp/c --contexts 256 --new 8 16 --repeats 1 --backend eager   # quick look
    python eval/bench_compile.py --out DIR --device cuda --mode reduce-overhead   # GPU: CUDA graphs

`generate()` compiles the decode forward of a cache that declares `is_compileable` (StaticCache, and
DenseCache / PagedCache / SinkCache / H2OCache built with `compile=on`; the dense and paged ones sized like
StaticCache): the mask is built outside the graph, and each decode step
calls the compiled forward. This times that, per context length, on the tiny 8-layer Llama of
`bench_host.py`:

- decode ms per token: inside one `generate()` of `--new` N2 tokens, the time from token N1 to token N2
  (stamped by a stopping criterion that never stops) divided by N2 - N1, so neither the prefill nor its
  run-to-run noise enters (a difference of two generate() calls did: at 8K the prefill's noise came to
  several ms per token); after a warm-up that compiles every shape, median over `--repeats` runs; each
  cache is compiled and timed on its own, after `torch._dynamo.reset()` (one process, one cache, as users
  run it);
- its ratio to StaticCache compiled the same way (`max_cache_len` = prompt + N2, so it attends over the
  whole buffer, masked, as StaticCache does);
- DynamicCache and a SinkCache without `compile=on`, which generate() runs eagerly, as references.

Writes `compile.json`, `compile.md` and `compile.png` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_host import TINY, build_model
from tqdm import tqdm
from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

SPECS = ["static", "dynamic", "dense:compile=on", "paged:compile=on", "sink:4:1020", "sink:4:1020:compile=on", "h2o:1024:compile=on"]
COLUMNS = [
    ("context", "context", "d"),
    ("cache", "cache", ""),
    ("compiled", "compiled", ""),
    ("decode_ms", "decode ms/token", ".3f"),
    ("vs_static", "x StaticCache", ".2f"),
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


def decode_seconds(model, spec, prompt, new: tuple[int, int], max_length, config) -> float:
    """Seconds per token from token N1 to token N2 of one `generate()`: the prefill is outside the span."""
    n1, n2 = new
    cache = spec.build(model.config, max_length=max_length)
    clock = StepClock()
    model.generate(prompt, past_key_values=cache, max_new_tokens=n2, min_new_tokens=n2, do_sample=False,
                   compile_config=config, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))  # fmt: skip
    return (clock.stamps[n2 - 1] - clock.stamps[n1 - 1]) / (n2 - n1)


def markdown(result: dict) -> str:
    from hf_kvplus.evaluation.report import format_table

    a = result["args"]
    return "\n".join([
        "## Compiled decode against StaticCache",
        "",
        f"tiny Llama ({TINY['num_hidden_layers']} layers, hidden {TINY['hidden_size']}), float32, {a['device']}, "
        f"backend {a['backend']}, mode {a['mode']}, {a['threads']} thread(s); decode time from generate() of "
        f"tokens {a['new'][0]} to {a['new'][1]} of one call, median of {a['repeats']}; {result['machine']}, {result['date']}",
        "",
        "```",
        format_table(result["rows"], COLUMNS),
        "```",
        "",
    ])  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(caches)
    for i, cache in enumerate(caches):
        ratios = [next(r["vs_static"] for r in rows if r["cache"] == cache and r["context"] == c) for c in contexts]
        axis.bar([k + i * width for k in range(len(contexts))], ratios, width, label=cache)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([k + 0.4 - width / 2 for k in range(len(contexts))], [f"{c} tokens" for c in contexts])
    axis.set_ylabel("decode time per token, x StaticCache compiled")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@torch.no_grad()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for compile.json, compile.md and compile.png")
    parser.add_argument("--specs", nargs="+", default=SPECS, help="cache specs; static must be among them")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192], help="prompt lengths")
    parser.add_argument("--new", type=int, nargs=2, default=[8, 72], metavar=("N1", "N2"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", default=None, help="torch.compile mode (reduce-overhead: CUDA graphs)")
    args = parser.parse_args(argv)
    if "static" not in args.specs:
        parser.error("the specs must include static, the baseline")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # one graph set per context length and cache
    from hf_kvplus.evaluation.report import stamp
    from hf_kvplus.specs import parse_cache_spec

    config = CompileConfig(backend=args.backend, mode=args.mode, fullgraph=True)
    config._compile_all_devices = True  # generate() compiles on CUDA only, unless told
    model = build_model().to(args.device)
    specs = [parse_cache_spec(s) for s in args.specs]
    n1, n2 = args.new
    rows = []
    for context in args.contexts:
        prompt = torch.randint(0, TINY["vocab_size"], (1, context), generator=torch.Generator().manual_seed(context))
        prompt = prompt.to(args.device)
        times = {spec.text: [] for spec in specs}
        for spec in tqdm(specs, desc=f"{context} tokens", file=sys.stderr):
            # Each cache compiles alone, as in a process that uses one cache: graphs of several caches under one
            # compiled forward share its automatic-dynamic state, and inductor (torch 2.13, CPU) then generated
            # code naming an unbound size symbol for H2O's graph after SinkCache's (NameError at run time).
            torch._dynamo.reset()
            decode_seconds(model, spec, prompt, (n1, n2), context + n2, config)  # compiles every shape of the run
            for _ in range(args.repeats):
                times[spec.text].append(decode_seconds(model, spec, prompt, (n1, n2), context + n2, config))
        for spec in specs:
            compiled = spec.build(model.config, max_length=context + n2).is_compileable
            rows.append({"context": context, "cache": spec.text, "compiled": "yes" if compiled else "no (eager)",
                         "decode_ms": statistics.median(times[spec.text]) * 1e3})  # fmt: skip
        base = next(r["decode_ms"] for r in rows if r["context"] == context and r["cache"] == "static")
        for row in rows:
            if row["context"] == context:
                row["vs_static"] = row["decode_ms"] / base
    result = {**stamp(), "args": {**{k: str(v) for k, v in vars(args).items()}, "new": args.new}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "compile.md").write_text(md)
    plot(rows, args.out / "compile.png")
    print(md)


if __name__ == "__main__":
    main()
