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
"""

from __future__ import annotations

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
from ..memory import cache_bytes
from ..specs import CacheSpec
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
            row["seconds"] = sum(t.seconds for t in self.trials if t.cache == cache)
            rows.append(row)
        return rows

    def to_json(self, path: str | Path, meta: dict | None = None) -> None:
        data = {**(meta or {}), "lengths": self.lengths, "depths": self.depths, "caches": self.caches,
                "tasks": self.tasks, "summary": self.summary(), "trials": [asdict(t) for t in self.trials]}  # fmt: skip
        Path(path).write_text(json.dumps(data, indent=2))

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


def is_correct(answer: str, key: str) -> bool:
    """Exact match of the answer's first number with the key."""
    return PassKey().score(answer, [key])


def needle_grid(
    model: PreTrainedModel,
    tokenizer,
    haystack: list[int] | torch.Tensor,
    specs: list[CacheSpec],
    lengths: list[int],
    depths: list[float],
    *,
    trials: int = 1,
    new_tokens: int | None = None,
    seed: int = 0,
    tasks: list[RetrievalTask] | None = None,
) -> NeedleResult:
    """Runs every (task, length, depth, trial) prompt through every cache spec, greedy: `new_tokens` answer
    tokens (None: each task's own). `tasks` defaults to the pass key (`retrieval_tasks`).

    The prompts come from `seed` and are the same for every cache, so the caches answer the same prompts."""
    tasks = [PassKey()] if tasks is None else list(tasks)
    if not specs or not lengths or not depths or trials < 1 or not tasks:
        raise ConfigError("a needle grid needs at least one cache spec, task, length, depth and trial")
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
                cache = spec.build(model.config, max_length=length + new)
                ids = prompt.ids.to(model.device)
                start = time.perf_counter()
                with torch.no_grad():
                    generated = model.generate(
                        ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=new,
                        do_sample=False, pad_token_id=pad,
                    )  # fmt: skip
                answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
                out.append(NeedleTrial(spec.text, task.name, length, depth, ",".join(prompt.expected), answer,
                                       task.score(answer, prompt.expected), cache_bytes(cache),
                                       time.perf_counter() - start))  # fmt: skip
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
