"""What a decode step costs the host, for every cache against DynamicCache and StaticCache in one run.

    python eval/bench_host.py --out eval/results/host_cpu
    python eval/bench_host.py --out /tmp/host --steps 8 --repeats 1 --specs dynamic dense   # quick look

On a GPU one layer's decode takes ~100-200 us for an 8B model, so the Python and dispatch work around
the kernels decides speed. This measures that work on a tiny 8-layer Llama whose attention costs almost
nothing, so a decode step's time is the host's. Per cache spec:

- host time per decode step (eager, greedy, one thread): the fastest of `--repeats` runs (interference
  on a shared machine only adds time) of the mean step time of `--steps` steps after a `--prompt`-token
  prefill, caches alternating within each repeat, and its ratio to DynamicCache's;
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


def time_steps(model, spec, prompt, steps, stub: bool = False) -> tuple[float, float, float]:
    """Mean seconds per decode step, the part of it spent in kernels (or their twins; with `stub`, in the stubs
    that stand for them), and kernel calls per step."""
    cache, token = prefilled(model, spec, prompt, steps)
    with (stubbing_kernels if stub else timing_kernels)() as kernels:
        start = CLOCK()
        for _ in range(steps):
            token = decode(model, cache, token)
        total = CLOCK() - start
    return total / steps, kernels.seconds / steps, kernels.calls / steps


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
        f"thread(s), prompt {a['prompt']}, {a['steps']} decode steps, the fastest of {a['repeats']} alternating runs "
        f"(interference only adds time); {'CPU time of the thread' if a.get('cpu_time') else 'wall time'}; "
        f"{result['machine']}, {result['date']}; \"outside\": the step time less "
        "the time inside kernels (attention and quantize: torch twins off CUDA; SDPA for Transformers' caches); "
        "\"stubbed\": the step with every kernel replaced by a stub that returns zeros of its output's shape "
        "(`stubbing_kernels`), its time less the stubs'",
        "",
        "```",
        format_table(result["rows"], COLUMNS),
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
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
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
    for spec in specs:  # warm-up: first-call costs (lazy imports, allocator) out of the timings
        time_steps(model, spec, prompt[:, :32], 2)
        time_steps(model, spec, prompt[:, :32], 2, stub=True)
    times = {spec.text: [] for spec in specs}  # (step, in kernels, kernel calls) per repeat
    stubbed = {spec.text: [] for spec in specs}
    with cpu_time() if args.cpu_time else contextlib.nullcontext():
        for _ in tqdm(range(args.repeats), desc="repeats", file=sys.stderr):
            for spec in specs:
                times[spec.text].append(time_steps(model, spec, prompt, args.steps))
                stubbed[spec.text].append(time_steps(model, spec, prompt, args.steps, stub=True))
    rows = []
    for spec in tqdm(specs, desc="calls, syncs, graph breaks", file=sys.stderr):
        cache, token = prefilled(model, spec, prompt, args.steps)
        calls = count_cache_calls(lambda cache=cache, token=token: decode(model, cache, token))
        cache, token = prefilled(model, spec, prompt, args.steps)
        syncs = count_syncs(lambda cache=cache, token=token: decode(model, cache, token))
        breaks, reasons = ("-", []) if args.no_explain else graph_breaks(model, spec, prompt, args.steps)
        timed = times[spec.text]
        rows.append({
            "cache": spec.text, "step_ms": min(t for t, _, _ in timed) * 1e3,
            "kernel_ms": min(k for _, k, _ in timed) * 1e3,
            "outside_ms": min(t - k for t, k, _ in timed) * 1e3,
            "stubbed_ms": min(t - k for t, k, _ in stubbed[spec.text]) * 1e3,
            "kernels_per_layer": timed[0][2] / TINY["num_hidden_layers"],
            "calls_per_layer": calls / TINY["num_hidden_layers"], "syncs_per_step": sum(syncs.values()),
            "syncs_by_op": dict(syncs), "graph_breaks": breaks, "break_reasons": reasons,
        })  # fmt: skip
    base = next(r for r in rows if r["cache"] == "dynamic")
    for row in rows:
        row["vs_dynamic"] = row["step_ms"] / base["step_ms"]
        row["outside_vs_dynamic"] = row["outside_ms"] / base["outside_ms"]
        row["stubbed_vs_dynamic"] = row["stubbed_ms"] / base["stubbed_ms"]
    result = {**stamp(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    result["args"].update(threads=args.threads, prompt=args.prompt, steps=args.steps, repeats=args.repeats,
                          cpu_time=args.cpu_time)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "host.md").write_text(md)
    plot(rows, args.out / "host.png")
    print(md)


if __name__ == "__main__":
    main()
