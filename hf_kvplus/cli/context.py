"""`kvplus context`: prefill a long context once, compress it, save it; later, in any process, load it and ask.

`kvplus context save FILE` builds a context of `--tokens` tokens of real text with `--needles` facts hidden at spread
depths ("The special number of <city> is <5 digits>."), prefills it into `--cache` (KVzip compresses it then; KVzap
and the other evicting caches as they prefill), and writes FILE (the cache) and FILE.json (the context's token ids,
the questions and their answers). `kvplus context ask FILE` loads the cache once per question, in this process, and
answers each question appended after the context, timing the load against the prefill it replaces.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..evaluation.needle import template_prefix
from ..evaluation.retrieval_tasks import assemble, encode, frame
from ..evicting_cache import EvictingCache
from ..kvzip_cache import KVzipCache
from ..persist import load_cache
from ..specs import parse_cache_spec
from ..transformers_compat import cache_kwargs
from . import common

INSTRUCTION = "Some special numbers are hidden inside a long text. Find them and remember them."
NEEDLE = "\nThe special number of {city} is {key}. Remember: {city}, {key}.\n"
QUESTION = "What is the special number of {city}?"
ANSWER_START = "The special number of {city} is"
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tromso", "Hanoi", "Dakar", "Perth", "Bergen", "Cusco"]
#: KVzip keeping this share of the context, when no --cache is given.
DEFAULT_KEEP = 0.15


def register(subparsers) -> None:
    parser = subparsers.add_parser("context", help="save a compressed long context once, load it and ask it questions")
    actions = parser.add_subparsers(dest="action", required=True)
    save = actions.add_parser("save", help="prefill and compress a context with hidden facts, then save the cache")
    save.add_argument("file", type=Path, help="the cache file to write (FILE.json gets the context and questions)")
    common.add_model_args(save)
    save.add_argument("--cache", default=None,
                      help=f"cache spec (default kvzip:N, N = {DEFAULT_KEEP:.0%} of --tokens)")  # fmt: skip
    save.add_argument("--tokens", type=int, default=2048, help="context length in tokens (default 2048)")
    save.add_argument("--needles", type=int, default=4, help=f"facts hidden in the context (at most {len(CITIES)})")
    save.add_argument("--seed", type=int, default=0, help="seed of the hidden numbers")
    save.set_defaults(func=run_save)
    ask = actions.add_parser("ask", help="load a saved context and answer its questions (or --question ones)")
    ask.add_argument("file", type=Path, help="a cache file written by `kvplus context save`")
    common.add_model_args(ask, text=False)
    ask.add_argument("--question", action="append", default=None, help="a question of your own (repeatable)")
    ask.add_argument("--new-tokens", type=int, default=12, help="answer tokens generated (default 12)")
    ask.set_defaults(func=run_ask)


def build_context(tokenizer, haystack: list[int], tokens: int, needles: int, seed: int) -> tuple[list[int], list]:
    """The context's ids (the chat template's start, the instruction, text with the facts) and the facts."""
    if not 1 <= needles <= len(CITIES):
        raise ConfigError(f"--needles must be in 1..{len(CITIES)}, got {needles}")
    rng = random.Random(seed)
    facts = [(city, str(rng.randint(10000, 99999))) for city in rng.sample(CITIES, needles)]
    inserts = [((i + 0.5) / needles, encode(tokenizer, NEEDLE.format(city=c, key=k))) for i, (c, k) in enumerate(facts)]
    before, _ = frame(tokenizer, INSTRUCTION, "", "")
    ids, _ = assemble((before, []), haystack, inserts, tokens)
    return ids[0].tolist(), facts


def question_ids(tokenizer, question: str, answer_start: str) -> list[int]:
    """The end of the user turn (the question), the assistant's turn and the start of its answer."""
    return frame(tokenizer, INSTRUCTION, question, answer_start)[1]


def run_save(args) -> int:
    common.setup(args)
    model, tokenizer, text = common.load(args)
    haystack = common.tokenize(tokenizer, text, args.tokens * 2).tolist()
    context, facts = build_context(tokenizer, haystack, args.tokens, args.needles, args.seed)
    ids = torch.tensor([context], device=model.device)
    args.cache = args.cache or f"kvzip:{int(DEFAULT_KEEP * len(context))}"
    spec = parse_cache_spec(args.cache)
    cache = spec.build(model.config, max_length=len(context) + 64)
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), logits_to_keep=1)
        if isinstance(cache, KVzipCache):  # KVzip scores the context by reconstructing the user's turn
            cache.compress(model, ids[:, template_prefix(tokenizer, ids) :], tokenizer)
    prefill = time.perf_counter() - start
    cache.save(args.file, spec=args.cache)
    sidecar = {"model": args.model, "cache": args.cache, "context": context, "prefill_seconds": prefill,
               "facts": [{"question": QUESTION.format(city=c), "answer_start": ANSWER_START.format(city=c), "answer": k}
                         for c, k in facts]}  # fmt: skip
    Path(f"{args.file}.json").write_text(json.dumps(sidecar))
    report = cache.memory_report()
    done = "prefilled and compressed" if report.tokens_held < report.tokens_seen else "prefilled"
    print(f"{done} {len(context)} tokens in {prefill:.1f} s; kept {report.tokens_held} of "
          f"{report.tokens_seen} per layer and row; {cache.nbytes:,} bytes at rest, "
          f"{args.file.stat().st_size:,} bytes on disk: {args.file}")  # fmt: skip
    return 0


def run_ask(args) -> int:
    common.setup(args)
    sidecar = json.loads(Path(f"{args.file}.json").read_text())
    model, tokenizer, _ = common.load(args, text=False)
    facts = sidecar["facts"]
    if args.question:
        facts = [{"question": q, "answer_start": "", "answer": None} for q in args.question]
    context = torch.tensor([sidecar["context"]], device=model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    right = 0
    for fact in facts:
        start = time.perf_counter()
        cache = load_cache(args.file, model.config)
        loaded = time.perf_counter() - start
        asked = torch.tensor([question_ids(tokenizer, fact["question"], fact["answer_start"])], device=model.device)
        ids = torch.cat([context, asked], dim=1)
        appending = cache.appending() if isinstance(cache, EvictingCache) else contextlib.nullcontext()
        with torch.no_grad(), appending:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache),
                                 max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)  # fmt: skip
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        verdict = "" if fact["answer"] is None else (" right" if fact["answer"] in answer else f" wrong ({fact['answer']})")
        right += fact["answer"] is not None and fact["answer"] in answer
        print(f"[load {loaded:.2f} s] {fact['question']} -> {fact['answer_start']} {answer}{verdict}")
    if not args.question:
        print(f"{right} of {len(facts)} right; the prefill this load replaces took {sidecar['prefill_seconds']:.1f} s")
    return 0

