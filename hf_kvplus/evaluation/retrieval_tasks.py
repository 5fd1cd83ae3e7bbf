"""Synthetic retrieval tasks in a haystack of real text, after RULER (Hsieh et al., 2024): no download, exact scoring.

Each task builds, for a context length and a depth, a prompt of exactly that many tokens (an instruction, the
haystack with the task's sentences inserted, the question and the start of the answer, inside the model's chat
template when its tokenizer has one) and the answers it expects; `score` says whether a generated answer holds
them. The tasks differ in what a cache must keep:

- `passkey`: one five-digit key (the classic needle);
- `multikey`: four "magic numbers", each for its own word; the question names one (the others are distractors);
- `multivalue`: four magic numbers for the same word, spread from the depth on; all four must be recalled;
- `vartrack`: a chain of variable assignments (`VAR QWKZB = 47381`, then `VAR LMPRA = QWKZB`, ...) spread from the
  depth on; every variable holding the value must be named;
- `cwe` (common-word extraction): a numbered list of words in place of the haystack, three of them far more
  frequent than the rest; the three must be named (the depth plays no part).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError

_MARKER = "\x00HAYSTACK\x00"
#: Words the tasks draw their keys and lists from: common, single-token-ish English nouns.
WORDS = (
    "apple", "river", "garden", "window", "silver", "candle", "harbor", "forest", "pencil", "mirror", "engine",
    "blanket", "castle", "meadow", "violin", "ladder", "basket", "pepper", "marble", "anchor", "button", "cotton",
    "dragon", "feather", "glacier", "hammer", "island", "jacket", "kettle", "lantern", "magnet", "napkin",
    "orchard", "parrot", "quartz", "rocket", "saddle", "tunnel", "umbrella", "valley", "walnut", "yellow",
    "zipper", "bridge", "carpet", "desert", "falcon", "ginger", "helmet", "insect", "jungle", "kitten", "lemon",
    "monkey", "needle", "office", "pillow", "rabbit", "summer", "ticket",
)  # fmt: skip


@dataclass
class TaskPrompt:
    """One prompt of a task: `[1, length]` ids, the answers it expects, the token index of its first insert, and how
    many of its last tokens are the question (and the start of the answer): the rest is the context, which a
    query-agnostic evaluation compresses before the question arrives."""

    ids: torch.Tensor
    expected: list[str]
    at: int
    question: int = 0

    @property
    def context(self) -> int:
        """Tokens before the question."""
        return self.ids.shape[1] - self.question


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def frame(tokenizer, instruction: str, question: str, answer_start: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the haystack: the instruction, then the question and the start of the answer;
    inside the chat template (one user turn, then the assistant's) when the tokenizer has one."""
    content = f"{instruction}\n\n{_MARKER}\n\n{question}"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = content + "\n"
    before, after = text.split(_MARKER)
    return encode(tokenizer, before), encode(tokenizer, after + answer_start)


def assemble(
    framing: tuple[list[int], list[int]], haystack: list[int], inserts: list[tuple[float, list[int]]], length: int
) -> tuple[torch.Tensor, int]:
    """`[1, length]` ids: the frame around the haystack with each insert `(depth, ids)` after `depth` of the
    haystack tokens (in depth order), and the token index of the first insert."""
    for depth, _ in inserts:
        if not 0.0 <= depth <= 1.0:
            raise ConfigError(f"a needle depth is a fraction of the haystack in 0..1, got {depth}")
    before, after = framing
    room = length - len(before) - len(after) - sum(len(ids) for _, ids in inserts)
    if room < 1:
        raise ConfigError(
            f"a {length}-token prompt has no room for a haystack: instruction, needles and question take "
            f"{length - room} tokens"
        )
    if room > len(haystack):
        raise ConfigError(f"a {length}-token prompt needs {room} haystack tokens, the text has {len(haystack)}")
    ids, cut, first = list(before), 0, None
    for depth, needle in sorted(inserts, key=lambda insert: insert[0]):
        at = round(depth * room)
        ids += haystack[cut:at]
        first = len(ids) if first is None else first
        ids += needle
        cut = at
    ids += haystack[cut:room] + after
    return torch.tensor([ids]), first


def _numbers(answer: str) -> list[str]:
    return re.findall(r"\d+", answer)


def _words(answer: str) -> set[str]:
    return set(re.findall(r"[A-Za-z]+", answer))


def _spread(depth: float, count: int) -> list[float]:
    """`count` depths from `depth` on, evenly to the end of the haystack."""
    step = (1.0 - depth) / count
    return [depth + i * step for i in range(count)]


class RetrievalTask:
    """A synthetic retrieval task: `build` one prompt, `score` one answer. `new_tokens`: answer tokens to generate."""

    name: str
    new_tokens: int

    def build(self, tokenizer, haystack: list[int], length: int, depth: float, rng: random.Random) -> TaskPrompt:
        raise NotImplementedError

    def score(self, answer: str, expected: list[str]) -> bool:
        """Every expected answer is in `answer` (as a number or a word)."""
        found = set(_numbers(answer)) | _words(answer)
        return all(item in found for item in expected)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PassKey(RetrievalTask):
    name, new_tokens = "passkey", 8
    instruction = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it."
    question = "What is the pass key?"
    answer_start = "The pass key is"
    needle = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"

    def build(self, tokenizer, haystack, length, depth, rng):
        key = str(rng.randint(10000, 99999))
        framing = frame(tokenizer, self.instruction, self.question, self.answer_start)
        ids, at = assemble(framing, haystack, [(depth, encode(tokenizer, self.needle.format(key=key)))], length)
        return TaskPrompt(ids, [key], at, len(framing[1]))

    def score(self, answer, expected):
        """Exact match of the answer's first number with the key."""
        numbers = _numbers(answer)
        return bool(numbers) and numbers[0] == expected[0]


class MultiKey(PassKey):
    name, new_tokens = "multikey", 10
    instruction = "Some special magic numbers are hidden inside the following text. Make sure to memorize them."
    needle = "\nOne of the special magic numbers for {word} is: {key}.\n"
    keys = 4

    def build(self, tokenizer, haystack, length, depth, rng):
        words = rng.sample(WORDS, self.keys)
        keys = [str(rng.randint(10000, 99999)) for _ in words]
        depths = [depth] + [rng.random() for _ in words[1:]]  # the first word's number is asked for
        framing = frame(tokenizer, self.instruction, f"What is the special magic number for {words[0]}?",
                        f"The special magic number for {words[0]} is")  # fmt: skip
        inserts = [(d, encode(tokenizer, self.needle.format(word=w, key=k)))
                   for d, w, k in zip(depths, words, keys, strict=True)]  # fmt: skip
        ids, at = assemble(framing, haystack, inserts, length)
        return TaskPrompt(ids, [keys[0]], at, len(framing[1]))


class MultiValue(RetrievalTask):
    name, new_tokens = "multivalue", 48  # room for a numbered list of four
    instruction = MultiKey.instruction
    needle = MultiKey.needle
    values = 4

    def build(self, tokenizer, haystack, length, depth, rng):
        word = rng.choice(WORDS)
        keys = [str(rng.randint(10000, 99999)) for _ in range(self.values)]
        framing = frame(tokenizer, self.instruction, f"What are all the special magic numbers for {word}?",
                        f"The special magic numbers for {word} are")  # fmt: skip
        inserts = [(d, encode(tokenizer, self.needle.format(word=word, key=k)))
                   for d, k in zip(_spread(depth, self.values), keys, strict=True)]  # fmt: skip
        ids, at = assemble(framing, haystack, inserts, length)
        return TaskPrompt(ids, keys, at, len(framing[1]))


class VariableTracking(RetrievalTask):
    name, new_tokens = "vartrack", 40
    instruction = "Memorize and track the chain of variable assignments hidden in the following text."
    hops = 3

    def build(self, tokenizer, haystack, length, depth, rng):
        value = str(rng.randint(10000, 99999))
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(self.hops)]
        sources = [value, *names[:-1]]
        framing = frame(tokenizer, self.instruction, f"Find all variables that are assigned the value {value}.",
                        f"The variables assigned the value {value} are:")  # fmt: skip
        inserts = [(d, encode(tokenizer, f"\nVAR {name} = {source}.\n"))
                   for d, name, source in zip(_spread(depth, self.hops), names, sources, strict=True)]  # fmt: skip
        ids, at = assemble(framing, haystack, inserts, length)
        return TaskPrompt(ids, names, at, len(framing[1]))


class CommonWords(RetrievalTask):
    name, new_tokens = "cwe", 16
    instruction = (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often."
    )
    common, share = 3, 0.5  # three words make up half of the list

    def build(self, tokenizer, haystack, length, depth, rng):
        framing = frame(tokenizer, self.instruction, "What are the 3 most common words in the list above?",
                        "The 3 words that appear most often in the list are:")  # fmt: skip
        room = length - len(framing[0]) - len(framing[1])
        words = rng.sample(WORDS, len(WORDS))
        common, rare = words[: self.common], words[self.common :]
        items: list[str] = []
        used = len(encode(tokenizer, self._listed([])))
        while True:  # grow the list by each item's own tokens until the room is full (one tokenization per item)
            word = rng.choice(common if rng.random() < self.share else rare)
            used += len(encode(tokenizer, f" {len(items) + 1}. {word}"))
            if used > room:
                break
            items.append(word)
        while len(encode(tokenizer, self._listed(items))) > room:  # tokens may merge across items: cut back
            items.pop()
        counts = {word: items.count(word) for word in set(items)}
        top = sorted(counts, key=lambda word: -counts[word])[: self.common]
        listed = encode(tokenizer, self._listed(items))
        filler = encode(tokenizer, "\n")[-1:] * (room - len(listed))  # line breaks to the exact length
        before, after = framing
        ids = torch.tensor([before + listed + filler + after])
        if ids.shape[1] != length:
            raise ConfigError(f"a {length}-token common-words prompt came out {ids.shape[1]} tokens long")
        return TaskPrompt(ids, top, len(before), len(after))

    @staticmethod
    def _listed(items: list[str]) -> str:
        return "\n" + " ".join(f"{i}. {word}" for i, word in enumerate(items, 1)) + "\n"


#: The tasks by name.
TASKS: dict[str, type[RetrievalTask]] = {
    task.name: task for task in (PassKey, MultiKey, MultiValue, VariableTracking, CommonWords)
}


def retrieval_task(name: str) -> RetrievalTask:
    """The task called `name` (one of `TASKS`)."""
    if name not in TASKS:
        raise ConfigError(f"unknown retrieval task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]()
