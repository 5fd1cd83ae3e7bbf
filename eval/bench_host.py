"""What a decode step costs the host, for every cache against DynamicCache and StaticCache in one run.

    python eval/bench_host.py --out eval/results/host_cpu
    python eval/bench_host.py --out /tmp/host --steps 8 --repeats 1 --specs dynamic dense   # quick look

On a GPU one layer's decode takes ~100-200 us for an 8B model, so the Python and dispatch work around
the kernels decides speed. This measures that work on a tiny 8-layer Llama whose attention costs almost
nothing, so a decode step's time is the host's. Per cache spec:

- host time per decode step (eager, greedy, one thread) and its ratio to DynamicCache's, measured in pairs:
  `--repeats` legs per cache, each a fresh `--prompt`-token prefill of DynamicCache and the cache, then rounds
  of `--round-steps` steps of each (the two blocks swapped every round) until `--steps` steps each; the ratio
  is the median over rounds of the round's two blocks, with its quartiles. Other jobs on a shared machine
  slow both blocks of a round alike (they are milliseconds apart), and the median drops the rounds a burst
  split; `dynamic`'s own row pairs DynamicCache with a second DynamicCache: its quartiles are the method's
  spread;
- the same with the time inside kernels (attention, quantize) taken out (`timing_kernels`), and its
  ratio: off CUDA a kernel is its torch twin, which pays on the host the compute a GPU does in one
  launch (dequantizing codes, gathering blocks);
- the step with every kernel stubbed (`stubbing_kernels`: zeros of the output's shape, no compute), its
  time less the stubs': the host work around the kernels with nothing of a twin's compute left in it
  (a twin that dequantizes every code also slows the code after it, which taking its time out leaves
  in), so this is the figure that carries over to a GPU, with the kernel calls per layer (each one a
  launch there);
- Python calls per layer per step made by cache code (functions defined in hf_kvplus or in
  Transformers' cache_utils.py), counted with `sys.setprofile` over one decode step;
- device-to-host syncs per decode step: the ops that force one on a GPU (`aten._local_scalar_dense`,
  which `.item()`, `bool()` and `int()` of a tensor run, `nonzero`, `equal`, `masked_select`,
  `unique`, `repeat_interleave` without an output size, boolean-mask indexing, `Tensor.tolist()`),
  counted by `hf_kvplus.evaluation.host_cost`;
- graph breaks of one decode step under `torch._dynamo.explain`, with the first reasons.

With `--cpu-time` every time above is this thread's CPU time (`time.thread_time`, the kernels' included: one
thread), not wall time: on a machine other jobs keep busy, wall time counts the time the process waits for a core,
which swamps the differences measured; CPU time does not (cache and memory contention still add to it).

Writes `host.json`, `host.md` (the table) and `host.png` (time and syncs per cache) into `--out`.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_kvplus import cache_kwargs
from hf_kvplus.evaluation import host_cost
from hf_kvplus.evaluation.host_cost import count_cache_calls, count_syncs, stubbing_kernels, timing_kernels

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=4096)  # fmt: skip
#: Every cache family at budgets that evict during the run (prompt 256 + 64 steps).
SPECS = [
    "dynamic", "static", "dense", "paged", "quantized:int8", "quantized:int4", "quantized:int2", "quantized:fp8",
    "paged-quantized:int4", "sink:4:252", "sink:4:252:bits=int4", "h2o:256", "h2o:256:bits=int4", "snapkv:256",
    "offloaded",
    "offloaded-quantized:int4", "hf-quantized:quanto:4", "quantized:k4v2", "quantized:k3v2", "sink:4:252:bits=k4v2",
]  # fmt: skip
COLUMNS = [
    ("cache", "cache", ""),
    ("step_ms", "host ms/step", ".3f"),
    ("vs_dynamic", "x Dynamic", ".2f"),
    ("vs_dynamic_iqr", "quartiles", ">"),
    ("kernel_ms", "in kernels ms", ".3f"),
    ("outside_ms", "outside ms", ".3f"),
    ("outside_vs_dynamic", "outside x Dynamic", ".2f"),
    ("stubbed_ms", "stubbed ms", ".3f"),
    ("stubbed_vs_dynamic", "stubbed x Dynamic", ".2f"),
    ("kernels_per_layer", "kernel calls/layer/step", ".1f"),
    ("calls_per_layer", "cache calls/layer/step", ".1f"),
    ("syncs_per_step", "syncs/step", "d"),
    ("graph_breaks", "graph breaks", ""),
]


def build_model(**shape):
    """The tiny Llama (`TINY`), with `shape`'s fields in place of its own."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, **shape})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def prefilled(model, spec, prompt, steps):
    cache = spec.build(model.config, max_length=prompt.shape[1] + steps + 2)
    logits = model(input_ids=prompt, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
    return cache, logits[:, -1:].argmax(-1)


def decode(model, cache, token):
    return model(input_ids=token, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)


#: The clock every time is read from (`--cpu-time`: this thread's CPU time).
CLOCK = time.perf_counter


@contextlib.contextmanager
def cpu_time():
    """Times steps and kernels by this thread's CPU time (`host_cost` reads `time.perf_counter` for the kernels')."""
    global CLOCK
    real = host_cost.time
    CLOCK, host_cost.time = time.thread_time, types.SimpleNamespace(perf_counter=time.thread_time)
    try:
        yield
    finally:
        CLOCK, host_cost.time = time.perf_counter, real


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile (linear interpolation)."""
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _outside(block: tuple[float, float, float]) -> float:
    """A block's seconds per step outside kernels."""
    return block[0] - block[1]


def paired_rounds(model, base, spec, prompt, steps, round_steps, stub: bool = False) -> list[dict]:
    """One leg: `base` (DynamicCache) and `spec` each prefilled with `prompt`, then rounds of `round_steps` decode
    steps of each, their order swapped every round (ABBA...), until `steps` steps each. Per round: both blocks'
    seconds per step and the part of it in kernels (with `stub`, in the stubs that stand for them), and kernel calls
    per step. Pairing the blocks a few milliseconds apart is what lets a busy machine's slow spells cancel in the
    ratio: they slow both blocks of a round alike, and the median over rounds drops the rounds they split."""
    caches = [prefilled(model, s, prompt, steps) for s in (base, spec)]
    tokens = [token for _, token in caches]
    rounds = []
    with (stubbing_kernels if stub else timing_kernels)() as kernels:
        for r in range(0, steps, round_steps):
            block = {}
            for side in ((0, 1) if (r // round_steps) % 2 == 0 else (1, 0)):
                cache = caches[side][0]
                n = min(round_steps, steps - r)
                seconds, calls = kernels.seconds, kernels.calls
                start = CLOCK()
                for _ in range(n):
                    tokens[side] = decode(model, cache, tokens[side])
                total = CLOCK() - start
                block[side] = (total / n, (kernels.seconds - seconds) / n, (kernels.calls - calls) / n)
            rounds.append({"base": block[0], "cache": block[1]})
    return rounds


def graph_breaks(model, spec, prompt, steps) -> tuple[int | str, list[str]]:
    import torch._dynamo

    cache, token = prefilled(model, spec, prompt, steps)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(model)(input_ids=token, **cache_kwargs(cache), use_cache=True)
    except Exception as exc:  # a cache dynamo cannot trace at all is reported, not hidden
        return "error", [f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"]
    reasons = [str(getattr(b, "reason", b)).splitlines()[0][:160] for b in explained.break_reasons]
    return explained.graph_break_count, list(dict.fromkeys(reasons))[:5]


def markdown(result: dict) -> str:
    from hf_kvplus.evaluation.report import format_table

    a = result["args"]
    lines = [
        "## Host cost of a decode step",
        "",
        f"tiny Llama ({TINY['num_hidden_layers']} layers, hidden {TINY['hidden_size']}), float32, {a['threads']} "
        f"thread(s), prompt {a['prompt']}; {a['repeats']} legs per cache, each a fresh prefill of DynamicCache and the "
        f"cache then {a['steps']} decode steps of each in rounds of {a.get('round_steps')} steps, the two blocks of a "
        "round swapped every round; times: medians over rounds of seconds per step; x Dynamic: the median over "
        "rounds of the ratio of the round's two blocks, with its quartiles (`dynamic`: DynamicCache against a second "
        f"DynamicCache, the method's own spread); {'CPU time of the thread' if a.get('cpu_time') else 'wall time'}; "
        f"{result['machine']}, {result['date']}, load {' -> '.join(f'{x:.1f}' for x in result['load_average'])}; "
        "\"outside\": the step time less "
        "the time inside kernels (attention and quantize: torch twins off CUDA; SDPA for Transformers' caches); "
        "\"stubbed\": the step with every kernel replaced by a stub that returns zeros of its output's shape "
        "(`stubbing_kernels`), its time less the stubs'",
        "",
        "```",
        format_table([{**r, "vs_dynamic_iqr": "{:.2f}-{:.2f}".format(*r["vs_dynamic_quartiles"])}
                      for r in result["rows"]], COLUMNS),
        "```",
        "",
        "Syncs by op and graph-break reasons:",
        "",
    ]
    for row in result["rows"]:
        syncs = ", ".join(f"{name} {n}" for name, n in row["syncs_by_op"].items()) or "none"
        reasons = "; ".join(row["break_reasons"]) or "none"
        lines.append(f"- `{row['cache']}`: syncs: {syncs}. Breaks: {reasons}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["cache"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 0.35 * len(rows) + 1.5), sharey=True)
    at = range(len(rows))
    for offset, key, label in ((-0.27, "vs_dynamic", "whole step"), (0, "outside_vs_dynamic", "outside kernels"),
                               (0.27, "stubbed_vs_dynamic", "kernels stubbed")):  # fmt: skip
        left.barh([i + offset for i in at], [r[key] for r in rows], height=0.27, label=label)
    left.set_yticks(list(at), names)
    left.axvline(1.25, color="red", linestyle="--", label="1.25x target")
    left.set_xlabel("host time per decode step, x DynamicCache")
    left.legend()
    left.invert_yaxis()
    right.barh(list(at), [r["syncs_per_step"] for r in rows])
    right.set_xlabel("device-to-host syncs per decode step")
    right.set_xlim(0, max(1, *(r["syncs_per_step"] for r in rows)))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@torch.no_grad()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for host.json, host.md and host.png")
    parser.add_argument("--specs", nargs="+", default=SPECS, help="cache specs; dynamic must be among them")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64, help="decode steps of each cache per leg")
    parser.add_argument("--repeats", type=int, default=3, help="legs per cache, each a fresh prefill of both caches")
    parser.add_argument("--round-steps", type=int, default=4,
                        help="decode steps of each cache per round (DynamicCache's block, then the cache's, swapped "
                        "every round)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-explain", action="store_true", help="skip the graph-break count (the slow part)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this thread's CPU time, not wall time (a busy machine; needs --threads 1)")
    args = parser.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time counts one thread's time: it needs --threads 1")
    torch.set_num_threads(args.threads)
    from hf_kvplus.evaluation.report import stamp
    from hf_kvplus.specs import parse_cache_spec

    specs = [parse_cache_spec(s) for s in args.specs]
    if "dynamic" not in args.specs:
        parser.error("the specs must include dynamic, the baseline")
    model = build_model()
    prompt = torch.randint(0, TINY["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0))
    base = parse_cache_spec("dynamic")
    for spec in specs:  # warm-up: first-call costs (lazy imports, allocator) out of the timings
        paired_rounds(model, base, spec, prompt[:, :32], 2, 1)
        paired_rounds(model, base, spec, prompt[:, :32], 2, 1, stub=True)
    timed = {spec.text: [] for spec in specs}  # rounds, over every leg
    stubbed = {spec.text: [] for spec in specs}
    load = [os.getloadavg()[0]]
    with cpu_time() if args.cpu_time else contextlib.nullcontext():
        for _ in tqdm(range(args.repeats), desc="repeats", file=sys.stderr):
            for spec in specs:
                timed[spec.text] += paired_rounds(model, base, spec, prompt, args.steps, args.round_steps)
                stubbed[spec.text] += paired_rounds(model, base, spec, prompt, args.steps, args.round_steps, stub=True)
    load.append(os.getloadavg()[0])
    rows = []
    for spec in tqdm(specs, desc="calls, syncs, graph breaks", file=sys.stderr):
        cache, token = prefilled(model, spec, prompt, args.steps)
        calls = count_cache_calls(lambda cache=cache, token=token: decode(model, cache, token))
        cache, token = prefilled(model, spec, prompt, args.steps)
        syncs = count_syncs(lambda cache=cache, token=token: decode(model, cache, token))
        breaks, reasons = ("-", []) if args.no_explain else graph_breaks(model, spec, prompt, args.steps)
        rounds, stubs = timed[spec.text], stubbed[spec.text]
        ratio = _quartiles([r["cache"][0] / r["base"][0] for r in rounds])
        rows.append({
            "cache": spec.text, "step_ms": statistics.median(r["cache"][0] for r in rounds) * 1e3,
            "vs_dynamic": ratio[1], "vs_dynamic_quartiles": [ratio[0], ratio[2]],
            "kernel_ms": statistics.median(r["cache"][1] for r in rounds) * 1e3,
            "outside_ms": statistics.median(r["cache"][0] - r["cache"][1] for r in rounds) * 1e3,
            "outside_vs_dynamic": statistics.median(_outside(r["cache"]) / _outside(r["base"]) for r in rounds),
            "stubbed_ms": statistics.median(_outside(r["cache"]) for r in stubs) * 1e3,
            "stubbed_vs_dynamic": statistics.median(_outside(r["cache"]) / _outside(r["base"]) for r in stubs),
            "rounds": len(rounds), "kernels_per_layer": rounds[0]["cache"][2] / TINY["num_hidden_layers"],
            "calls_per_layer": calls / TINY["num_hidden_layers"], "syncs_per_step": sum(syncs.values()),
            "syncs_by_op": dict(syncs), "graph_breaks": breaks, "break_reasons": reasons,
        })  # fmt: skip
    result = {**stamp(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    result["args"].update(threads=args.threads, prompt=args.prompt, steps=args.steps, repeats=args.repeats,
                          round_steps=args.round_steps, cpu_time=args.cpu_time)
    result["load_average"] = load  # the 1-minute load when the timings began and ended
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "host.md").write_text(md)
    plot(rows, args.out / "host.png")
    print(md)


if __name__ == "__main__":
    main()
