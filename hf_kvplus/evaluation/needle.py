"""Needle in a haystack (pass-key retrieval, and the RULER-style tasks of `retrieval_tasks`): whether a cache
still lets the model find what the question needs.

Perplexity averages over every token, so it barely moves when an evicting cache drops the one sentence
a later question needs. A trial here hides a sentence with a five-digit pass key at a fraction `depth`
of a haystack of real text, asks for the key at the end, and generates the answer greedily through the
cache; the trial is right when the first number in the answer is the key (the other tasks score as they say).
A grid of tasks x context lengths x depths (x `trials` prompts per cell) runs for each cache spec on the same
prompts, so a cell's accuracy differs between caches only by what the cache kept.

The prompt is an instruction, the haystack with the needle, the question and the start of the answer,
inside the model's chat template when its tokenizer has one. Its length is exact: the haystack fills
what the rest leaves of `length` tokens.

Two modes: "aware" (default) sends the whole prompt in one forward, so a cache that compresses its prompt sees the
question; "agnostic" sends the context (everything before the question) in one forward, which the cache compresses,
then the question and the answer with the cache's eviction paused (`EvictingCache.appending`), as kvpress's
pipeline does: what the cache kept was chosen before the question arrived. A `KVzipCache` is compressed by a
reconstruction of the context's user turn (`KVzipCache.compress`) right after that forward.

Each trial records the cache's bytes at rest read off the cache object after the answer (`memory_report()`:
payload and metadata, headroom apart) and that per token seen as a fraction of float16 K/V for the same tokens
(`fp16_token_bytes`), so a report can put accuracy against bytes (`plot_accuracy_bytes`). A spec whose budget is a
share of each prompt's context (`KeptShare`, "h2o:{budget}" at 20%) makes budgets that scale with the length.
"""

from __future__ import annotations

import contextlib
import csv
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..errors import ConfigError
from ..evicting_cache import EvictingCache
from ..kvzip_cache import KVzipCache
from ..memory import cache_bytes
from ..model_spec import ModelSpec
from ..specs import CacheSpec, parse_cache_spec
from ..transformers_compat import cache_kwargs
from .retrieval_tasks import PassKey, RetrievalTask, assemble, encode, frame

INSTRUCTION, QUESTION, ANSWER_START, NEEDLE = PassKey.instruction, PassKey.question, PassKey.answer_start, PassKey.needle


@dataclass
class NeedleTrial:
    """One prompt through one cache."""

    cache: str
    task: str
    length: int
    depth: float
    key: str  # the expected answer (several joined by commas)
    answer: str
    correct: bool
    bytes_at_rest: int
    seconds: float
    bytes_held: int = 0  # payload and metadata (no headroom), read off the cache after the answer
    tokens_seen: int = 0
    fp16_fraction: float = 0.0  # bytes_held per token seen over float16 K/V's bytes per token
    family: str = ""
    mode: str = "aware"


#: How a prompt reaches the cache: whole ("aware": the question is in the compressed prompt) or the context first
#: ("agnostic": compressed before the question, which is appended with eviction paused).
MODES = ("aware", "agnostic")


@dataclass(frozen=True)
class KeptShare:
    """A cache spec whose budget is a share of each prompt's context: `template` holds "{budget}" (e.g.
    "snapkv:{budget}:bits=int4"), replaced by round(`keep` x context tokens) for each prompt. `text` names it
    with the share ("snapkv:20%:bits=int4")."""

    template: str
    keep: float

    def __post_init__(self):
        if "{budget}" not in self.template:
            raise ConfigError(f"a kept-share spec needs '{{budget}}' in its template, got {self.template!r}")
        if not 0.0 < self.keep <= 1.0:
            raise ConfigError(f"the share of the context kept is in (0, 1], got {self.keep}")
        self.for_context(1000)  # a malformed template fails now, not at its first prompt

    @property
    def text(self) -> str:
        return self.template.replace("{budget}", f"{self.keep:.0%}")

    def budget(self, context: int) -> int:
        return max(1, round(self.keep * context))

    def for_context(self, context: int) -> CacheSpec:
        return parse_cache_spec(self.template.replace("{budget}", str(self.budget(context))))


def expand_specs(texts: list[str], keeps: list[float]) -> list[CacheSpec | KeptShare]:
    """Cache spec strings, each one holding "{budget}" once per share in `keeps` (`KeptShare`), the others parsed."""
    out: list[CacheSpec | KeptShare] = []
    for text in texts:
        if "{budget}" in text:
            if not keeps:
                raise ConfigError(f"the spec {text!r} has a {{budget}} placeholder: give the shares kept (--keep)")
            out += [KeptShare(text, keep) for keep in keeps]
        else:
            out.append(parse_cache_spec(text))
    return out


def fp16_token_bytes(config) -> int:
    """Bytes of one token's K/V in float16 over every layer that holds K/V: the reference of `fp16_fraction`."""
    return sum(2 * 2 * layer.num_kv_heads * layer.head_dim for layer in ModelSpec.from_config(config).layers
               if layer.holds_kv)  # fmt: skip


def held_bytes(cache) -> tuple[int, int]:
    """(payload + metadata bytes, tokens seen per row) read off a cache: hf_kvplus's `memory_report()`, or the
    tensors of any other `transformers.Cache` (`memory.cache_bytes`)."""
    if hasattr(cache, "memory_report"):
        report = cache.memory_report()
        return report.payload_bytes + report.metadata_bytes, report.tokens_seen * max(1, report.batch_size)
    return cache_bytes(cache), cache.get_seq_length()


def cache_family(cache) -> str:
    """"full precision", "quantized", "evicting" or "evicting + quantized", read off the cache object."""
    quantized = getattr(cache, "format", None) is not None or "Quantized" in type(cache).__name__
    if isinstance(cache, EvictingCache):
        return "evicting + quantized" if quantized else "evicting"
    return "quantized" if quantized else "full precision"


@dataclass
class NeedleResult:
    """Every trial of a grid, by cache spec in the order given (the first is the baseline)."""

    trials: list[NeedleTrial]
    lengths: list[int]
    depths: list[float]
    caches: list[str]
    tasks: list[str] = field(default_factory=lambda: ["passkey"])

    def accuracy(
        self, cache: str, length: int | None = None, depth: float | None = None, task: str | None = None
    ) -> float:
        """Fraction right among the trials of `cache` (at `length`, `depth` and of `task` when given)."""
        picked = [
            t.correct for t in self.trials
            if t.cache == cache and length in (None, t.length) and depth in (None, t.depth) and task in (None, t.task)
        ]  # fmt: skip
        return sum(picked) / len(picked)

    def summary(self) -> list[dict]:
        """One row per cache: accuracy overall, per length and (with several tasks) per task, bytes at rest at
        the longest length."""
        rows = []
        longest = max(self.lengths)
        for cache in self.caches:
            at_longest = [t.bytes_at_rest for t in self.trials if t.cache == cache and t.length == longest]
            row = {"cache": cache, "accuracy": self.accuracy(cache)}
            row.update({f"acc_{length}": self.accuracy(cache, length) for length in self.lengths})
            if len(self.tasks) > 1:
                row.update({f"acc_{task}": self.accuracy(cache, task=task) for task in self.tasks})
            row["bytes_at_rest"] = max(at_longest)
            mine = [t for t in self.trials if t.cache == cache]
            row["family"] = mine[0].family
            row["fp16_fraction"] = sum(t.fp16_fraction for t in mine) / len(mine)
            for length in self.lengths:
                at = [t.fp16_fraction for t in mine if t.length == length]
                row[f"frac_{length}"] = sum(at) / len(at)
            row["seconds"] = sum(t.seconds for t in mine)
            rows.append(row)
        return rows

    def to_json(self, path: str | Path, meta: dict | None = None) -> None:
        data = {**(meta or {}), "lengths": self.lengths, "depths": self.depths, "caches": self.caches,
                "tasks": self.tasks, "summary": self.summary(), "trials": [asdict(t) for t in self.trials]}  # fmt: skip
        Path(path).write_text(json.dumps(data, indent=2))

    @classmethod
    def from_json(cls, *paths: str | Path) -> NeedleResult:
        """The trials of `to_json` files, merged in order (caches of several runs on the same grid)."""
        trials, caches, lengths, depths, tasks = [], [], [], [], []
        for path in paths:
            data = json.loads(Path(path).read_text())
            trials += [NeedleTrial(**t) for t in data["trials"]]
            caches += [c for c in data["caches"] if c not in caches]
            lengths += [n for n in data["lengths"] if n not in lengths]
            depths += [d for d in data["depths"] if d not in depths]
            tasks += [t for t in data.get("tasks", ["passkey"]) if t not in tasks]
        return cls(trials, sorted(lengths), sorted(depths), caches, tasks)

    def to_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(self.trials[0])))
            writer.writeheader()
            writer.writerows(asdict(t) for t in self.trials)


def prompt_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The pass-key prompt's token ids before and after the haystack (`retrieval_tasks.frame`)."""
    return frame(tokenizer, INSTRUCTION, QUESTION, ANSWER_START)


def needle_ids(tokenizer, key: str) -> list[int]:
    return encode(tokenizer, NEEDLE.format(key=key))


def passkey_prompt(
    framing: tuple[list[int], list[int]], haystack: list[int], needle: list[int], length: int, depth: float
) -> tuple[torch.Tensor, int]:
    """`[1, length]` prompt ids with `needle` after `depth` of the haystack's tokens, and the needle's index."""
    return assemble(framing, haystack, [(depth, needle)], length)


def template_prefix(tokenizer, ids: torch.Tensor) -> int:
    """Tokens of the chat template's text before a user turn's content (a system turn, the user's header) when `ids`
    start with them, else 0: what a KVzip reconstruction does not repeat (kvpress's KVzipPress starts there too)."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    marker = "\x00needle\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    prefix = encode(tokenizer, text.split(marker, 1)[0])
    return len(prefix) if ids[0, : len(prefix)].tolist() == prefix else 0


def is_correct(answer: str, key: str) -> bool:
    """Exact match of the answer's first number with the key."""
    return PassKey().score(answer, [key])


def needle_grid(
    model: PreTrainedModel,
    tokenizer,
    haystack: list[int] | torch.Tensor,
    specs: list[CacheSpec | KeptShare],
    lengths: list[int],
    depths: list[float],
    *,
    trials: int = 1,
    new_tokens: int | None = None,
    seed: int = 0,
    tasks: list[RetrievalTask] | None = None,
    mode: str = "aware",
) -> NeedleResult:
    """Runs every (task, length, depth, trial) prompt through every cache spec, greedy: `new_tokens` answer
    tokens (None: each task's own). `tasks` defaults to the pass key (`retrieval_tasks`). `mode` (`MODES`): the
    whole prompt in one forward ("aware"), or the context compressed before the question ("agnostic").

    The prompts come from `seed` and are the same for every cache, so the caches answer the same prompts."""
    tasks = [PassKey()] if tasks is None else list(tasks)
    if not specs or not lengths or not depths or trials < 1 or not tasks:
        raise ConfigError("a needle grid needs at least one cache spec, task, length, depth and trial")
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    fp16 = fp16_token_bytes(model.config)
    haystack = haystack.tolist() if isinstance(haystack, torch.Tensor) else list(haystack)
    rng = random.Random(seed)
    cells = [(task, length, depth, task.build(tokenizer, haystack, length, depth, rng))
             for task in tasks for length in lengths for depth in depths for _ in range(trials)]  # fmt: skip
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    with tqdm(total=len(specs) * len(cells), desc="needle", unit="trial") as progress:
        for spec in specs:
            for task, length, depth, prompt in cells:
                new = task.new_tokens if new_tokens is None else new_tokens
                built = spec.for_context(prompt.context) if isinstance(spec, KeptShare) else spec
                cache = built.build(model.config, max_length=length + new)
                ids = prompt.ids.to(model.device)
                start = time.perf_counter()
                with torch.no_grad():
                    after = contextlib.nullcontext()
                    if mode == "agnostic" and prompt.question:
                        # The context alone, compressed as the cache's policy says; then the question, appended.
                        model(ids[:, : prompt.context], **cache_kwargs(cache), logits_to_keep=1)
                        if isinstance(cache, KVzipCache):  # KVzip: a reconstruction of the user's turn scores it
                            cache.compress(model, ids[:, template_prefix(tokenizer, ids) : prompt.context], tokenizer)
                        if isinstance(cache, EvictingCache):
                            after = cache.appending()
                    with after:
                        generated = model.generate(
                            ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=new,
                            do_sample=False, pad_token_id=pad,
                        )  # fmt: skip
                answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
                held, seen = held_bytes(cache)
                out.append(NeedleTrial(spec.text, task.name, length, depth, ",".join(prompt.expected), answer,
                                       task.score(answer, prompt.expected), cache_bytes(cache),
                                       time.perf_counter() - start, held, seen, held / (seen * fp16),
                                       cache_family(cache), mode))  # fmt: skip
                progress.update()
    return NeedleResult(out, list(lengths), list(depths), [spec.text for spec in specs], [task.name for task in tasks])


def plot_needle(result: NeedleResult, path: str | Path, title: str = "") -> None:
    """One heatmap per cache (per cache and task, with several tasks): accuracy by needle depth (rows) and context
    length (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result.tasks if len(result.tasks) > 1 else [None]
    panels = [(cache, task) for cache in result.caches for task in tasks]
    width = max(1.9, 0.9 * len(result.lengths))  # wide enough for a cache spec's title
    height = 1.4 + 0.45 * len(result.depths)
    figure, axes = plt.subplots(1, len(panels), figsize=(1.2 + width * len(panels), height), squeeze=False,
                                sharey=True)  # fmt: skip
    for ax, (cache, task) in zip(axes[0], panels, strict=True):
        grid = [[result.accuracy(cache, length, depth, task) for length in result.lengths] for depth in result.depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(result.lengths)), [str(length) for length in result.lengths])
        ax.set_yticks(range(len(result.depths)), [f"{depth:.0%}" for depth in result.depths])
        ax.set_xlabel("context tokens")
        name = cache if task is None else f"{cache}\n{task}"
        ax.set_title(f"{name}\n{result.accuracy(cache, task=task):.0%} right", fontsize=9)
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=7)
    axes[0][0].set_ylabel("needle depth")
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    if title:
        lines = 2 if tasks == [None] else 3  # of each panel's title
        figure.suptitle(title, fontsize=10, y=1 + (0.17 * lines + 0.1) / height)  # above them (inches over height)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


#: Marker and colour of each family in `plot_accuracy_bytes`.
FAMILY_STYLE = {"full precision": ("s", "black"), "quantized": ("o", "tab:blue"), "evicting": ("^", "tab:red"),
                "evicting + quantized": ("D", "tab:purple")}  # fmt: skip


def plot_accuracy_bytes(result: NeedleResult, path: str | Path, title: str = "") -> None:
    """Accuracy against bytes at rest per token seen as a fraction of float16 (log scale), one point per cache and
    one panel per context length, marked by family: the best cache for a memory budget is the highest point left of
    it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(result.lengths), figsize=(6.2 * len(result.lengths), 4.8), squeeze=False,
                                sharey=True)  # fmt: skip
    for ax, length in zip(axes[0], result.lengths, strict=True):
        seen = set()
        for cache in result.caches:
            mine = [t for t in result.trials if t.cache == cache and t.length == length]
            x = sum(t.fp16_fraction for t in mine) / len(mine)
            y = result.accuracy(cache, length)
            marker, color = FAMILY_STYLE.get(mine[0].family, ("x", "gray"))
            label = mine[0].family if mine[0].family not in seen else None
            seen.add(mine[0].family)
            ax.scatter([x], [y], marker=marker, color=color, s=42, label=label, zorder=3)
            ax.annotate(cache, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6.5, rotation=20)
        ax.set_xscale("log")
        ax.axvline(1.0, color="gray", linewidth=0.8, linestyle=":")
        ax.set(xlabel="bytes at rest per token seen / float16 K/V (read off the cache)", ylim=(-0.05, 1.1),
               title=f"{length} tokens")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
