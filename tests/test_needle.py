"""Needle in a haystack: the prompt hides the key where asked, answers are scored by exact match, lossless
caches answer exactly as DynamicCache does, and `kvplus needle` writes its table, JSON, CSV and heatmap."""

import json
import re

import pytest
import torch
from transformers import LlamaForCausalLM
from word_model import save_word_model

from hf_kvplus.cli import main
from hf_kvplus.errors import ConfigError
from hf_kvplus.evaluation.needle import (
    ANSWER_START,
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    KeptShare,
    expand_specs,
    fp16_token_bytes,
    is_correct,
    needle_grid,
    needle_ids,
    passkey_prompt,
    prompt_frame,
)
from hf_kvplus.evaluation.retrieval_tasks import TASKS, WORDS, MultiKey, PassKey, retrieval_task
from hf_kvplus.specs import parse_cache_spec

TEXT = " ".join("It is a truth universally acknowledged that a single man in possession of a good fortune".split() * 60)
#: Every word the prompt uses, so the word-level tokenizer knows them (pass keys included: five-digit numbers).
VOCAB = " ".join([TEXT, INSTRUCTION, QUESTION, ANSWER_START, NEEDLE, *map(str, range(10000, 100000, 7)), *WORDS,
                  MultiKey.instruction, MultiKey.needle, "What is the special magic number for"])


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer that knows the prompt's words, saved as a local folder."""
    folder = tmp_path_factory.mktemp("model")
    tokenizer = save_word_model(folder, VOCAB)
    text = tmp_path_factory.mktemp("text") / "book.txt"
    text.write_text(TEXT)
    return str(folder), str(text), tokenizer, LlamaForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_prompt_has_the_asked_length_and_the_needle_at_its_depth(local_model, depth):
    _, _, tokenizer, _ = local_model
    frame = prompt_frame(tokenizer)
    haystack = tokenizer(TEXT)["input_ids"]
    needle = needle_ids(tokenizer, "12345")
    ids, at = passkey_prompt(frame, haystack, needle, 200, depth)
    room = 200 - len(frame[0]) - len(frame[1]) - len(needle)
    assert ids.shape == (1, 200)
    assert ids[0, at : at + len(needle)].tolist() == needle
    assert at - len(frame[0]) == round(depth * room)
    assert ids[0, : len(frame[0])].tolist() == frame[0] and ids[0, -len(frame[1]) :].tolist() == frame[1]
    assert tokenizer.decode(ids[0, -len(frame[1]) :]).endswith(ANSWER_START)


def test_a_prompt_without_room_or_haystack_or_with_a_bad_depth_is_refused(local_model):
    _, _, tokenizer, _ = local_model
    frame, needle = prompt_frame(tokenizer), needle_ids(tokenizer, "12345")
    haystack = tokenizer(TEXT)["input_ids"]
    with pytest.raises(ConfigError, match="no room for a haystack"):
        passkey_prompt(frame, haystack, needle, 20, 0.5)
    with pytest.raises(ConfigError, match=r"needs \d+ haystack tokens, the text has 50"):
        passkey_prompt(frame, haystack[:50], needle, 200, 0.5)
    with pytest.raises(ConfigError, match="fraction of the haystack"):
        passkey_prompt(frame, haystack, needle, 200, 1.5)


@pytest.mark.parametrize(
    ("answer", "right"),
    [(" 12345. It is", True), ("12345", True), (" 123456", False), (" 54321 or 12345", False), (" the key", False)],
)
def test_an_answer_is_right_when_its_first_number_is_the_key(answer, right):
    assert is_correct(answer, "12345") is right


def test_lossless_caches_answer_every_prompt_as_dynamic_does(local_model):
    _, _, tokenizer, model = local_model
    haystack = tokenizer(TEXT)["input_ids"]
    specs = [parse_cache_spec(s) for s in ("dynamic", "dense", "paged:block=16")]
    result = needle_grid(model, tokenizer, haystack, specs, [120, 200], [0.2, 0.8], trials=2, new_tokens=4)
    assert len(result.trials) == 3 * 2 * 2 * 2
    by_cache = {spec.text: [(t.length, t.depth, t.key, t.answer) for t in result.trials if t.cache == spec.text]
                for spec in specs}
    assert len({key for *_, key, _ in by_cache["dynamic"]}) > 1  # distinct keys across cells
    assert by_cache["dense"] == by_cache["dynamic"] == by_cache["paged:block=16"]
    rows = {row["cache"]: row for row in result.summary()}
    for trial in result.trials:
        assert trial.correct == is_correct(trial.answer, trial.key)
    expected = sum(t.correct for t in result.trials if t.cache == "dense") / 8
    assert rows["dense"]["accuracy"] == expected and rows["dense"]["bytes_at_rest"] > 0


def test_kvplus_needle_writes_the_table_json_csv_and_heatmap(local_model, tmp_path, capsys):
    folder, text, _, _ = local_model
    code = main(["needle", "--model", folder, "--text", text, "--lengths", "100", "160", "--depths", "0.3", "0.7",
                 "--new-tokens", "3", "--cache", "dynamic", "--cache", "sink:2:40", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "needle.json").read_text())
    assert data["caches"] == ["dynamic", "sink:2:40"] and len(data["trials"]) == 2 * 2 * 2
    assert data["command"] and data["machine"]
    sink = next(row for row in data["summary"] if row["cache"] == "sink:2:40")
    dynamic = next(row for row in data["summary"] if row["cache"] == "dynamic")
    assert sink["bytes_at_rest"] < dynamic["bytes_at_rest"]  # 42 tokens kept of 163
    assert (tmp_path / "needle.csv").read_text().count("\n") == 1 + 8
    assert (tmp_path / "needle.png").stat().st_size > 0
    assert "bytes at 160" in capsys.readouterr().out


def test_the_context_compressed_before_the_question_gives_lossless_caches_the_same_answers(local_model):
    """Agnostic mode feeds the context, then the question through generate(): for a lossless cache (and an evicting
    one with room for everything) the answers are the aware mode's."""
    _, _, tokenizer, model = local_model
    haystack = tokenizer(TEXT)["input_ids"]
    specs = [parse_cache_spec("dense"), parse_cache_spec("h2o:400:compress=prefill")]
    runs = {mode: needle_grid(model, tokenizer, haystack, specs, [120, 200], [0.2, 0.8], new_tokens=4, mode=mode)
            for mode in ("aware", "agnostic")}  # fmt: skip
    answers = {mode: [(t.cache, t.key, t.answer) for t in result.trials] for mode, result in runs.items()}
    assert answers["aware"] == answers["agnostic"]
    assert {t.mode for t in runs["agnostic"].trials} == {"agnostic"}
    with pytest.raises(ConfigError, match="mode must be one of"):
        needle_grid(model, tokenizer, haystack, specs, [120], [0.5], mode="blind")


def test_the_question_appended_in_agnostic_mode_is_not_compressed_but_the_context_is(local_model):
    """A budget of 40 tokens: aware mode keeps 40 (+ the answer's tokens, appended); agnostic mode keeps 40 of the
    context plus the whole question: the bytes read off the cache differ by the question's tokens."""
    _, _, tokenizer, model = local_model
    haystack = tokenizer(TEXT)["input_ids"]
    question = len(prompt_frame(tokenizer)[1])
    held = {}
    for mode in ("aware", "agnostic"):
        result = needle_grid(model, tokenizer, haystack, [parse_cache_spec("h2o:40:compress=prefill")], [200], [0.5],
                             new_tokens=4, mode=mode)  # fmt: skip
        trial = result.trials[0]
        held[mode] = trial.bytes_held
        assert trial.tokens_seen == 203 and trial.family == "evicting"
    # The question's tokens held on top, at float32 (twice float16's payload); slot metadata grows with capacity.
    payload = 2 * fp16_token_bytes(model.config)
    assert question * payload <= held["agnostic"] - held["aware"] < question * payload * 2


def test_bytes_are_read_off_each_cache_as_a_fraction_of_float16(local_model):
    _, _, tokenizer, model = local_model
    haystack = tokenizer(TEXT)["input_ids"]
    specs = expand_specs(["dense", "quantized:int4:window=16", "snapkv:{budget}", "snapkv:{budget}:bits=int4"],
                         [0.25])  # fmt: skip
    assert [spec.text for spec in specs] == ["dense", "quantized:int4:window=16", "snapkv:25%", "snapkv:25%:bits=int4"]
    result = needle_grid(model, tokenizer, haystack, specs, [200], [0.5], new_tokens=4)
    got = {t.cache: t for t in result.trials}
    cfg = model.config
    assert fp16_token_bytes(cfg) == 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads)
    assert got["dense"].fp16_fraction == pytest.approx(2.0)  # float32 K/V: twice float16's bytes
    assert got["dense"].family == "full precision" and got["quantized:int4:window=16"].family == "quantized"
    assert got["snapkv:25%:bits=int4"].family == "evicting + quantized"
    fractions = [got[name].fp16_fraction for name in ("dense", "quantized:int4:window=16", "snapkv:25%",
                                                      "snapkv:25%:bits=int4")]  # fmt: skip
    assert fractions[0] > max(fractions[1:]) and fractions[3] < min(fractions[1:3]) and fractions[3] < fractions[2] / 2
    context = 200 - len(prompt_frame(tokenizer)[1])
    assert KeptShare("snapkv:{budget}", 0.25).budget(context) == round(0.25 * context)
    with pytest.raises(ConfigError, match="placeholder"):
        expand_specs(["h2o:{budget}"], [])
    with pytest.raises(ConfigError, match=r"in \(0, 1\], got 1.5"):
        KeptShare("h2o:{budget}", 1.5)


def test_kvplus_needle_with_shares_kept_writes_the_accuracy_against_bytes_plot(local_model, tmp_path, capsys):
    folder, text, _, _ = local_model
    code = main(["needle", "--model", folder, "--text", text, "--lengths", "120", "--depths", "0.5", "--new-tokens",
                 "3", "--cache", "dense", "--cache", "peak:{budget}:compress=prefill", "--keep", "0.2", "0.5",
                 "--mode", "agnostic", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "needle.json").read_text())
    assert data["caches"] == ["dense", "peak:20%:compress=prefill", "peak:50%:compress=prefill"]
    assert data["mode"] == "agnostic" and data["keep"] == [0.2, 0.5]
    fractions = {row["cache"]: row["frac_120"] for row in data["summary"]}
    assert fractions["dense"] > fractions["peak:50%:compress=prefill"] > fractions["peak:20%:compress=prefill"]
    assert (tmp_path / "accuracy_bytes.png").stat().st_size > 0
    assert "x fp16 at 120" in capsys.readouterr().out


def test_the_kvpress_comparison_runs_its_hf_kvplus_half_and_scores_the_full_cache_as_perplexity_does(
    local_model, tmp_path
):
    """eval/compare_kvpress.py without kvpress (its other half needs transformers < 5.3): the inputs, every
    hf_kvplus method at a ratio in both modes (KVzip's reconstruction included), the report; the full cache's
    continuation perplexity is `perplexity`'s."""
    import argparse
    import importlib.util
    from pathlib import Path

    from transformers import DynamicCache

    from hf_kvplus.evaluation import perplexity

    path = Path(__file__).parents[1] / "eval" / "compare_kvpress.py"
    spec = importlib.util.spec_from_file_location("compare_kvpress", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    _, text, tokenizer, model = local_model
    args = argparse.Namespace(text=text, context=120, continuation=6, depths=[0.5], ratios=[0.5], model="tiny",
                              out=tmp_path, modes=["aware", "agnostic"])  # a budget of 60: SnapKV's window shrinks to 30
    inputs = compare.build_inputs(tokenizer, args)
    assert len(inputs["text_ids"]) == 126 and len(inputs["needles"][0]["ids"]) == 120
    rows = compare.run_kvplus(model, tokenizer, inputs, new_tokens=3)
    assert [r["method"] for r in rows][1:] == list(compare.kvplus_specs(60))
    want = perplexity(model, torch.tensor(inputs["text_ids"]), lambda: DynamicCache(config=model.config),
                      mode="continuation", prompt_tokens=120, progress=False).continuation_perplexity
    assert rows[0]["continuation_ppl"] == pytest.approx(want, rel=1e-4)
    compare.report(rows, inputs, args, {})
    table = json.loads((tmp_path / "compare.json").read_text())["rows"]
    assert table[0]["budget"] == 120 and {r["budget"] for r in table[1:]} == {60}
    assert {p.name for p in tmp_path.iterdir()} == {"compare.json", "compare.csv", "compare.md", "compare.png"}
    question = inputs["needles"][0]["question"]
    assert 0 < question < 120 and all(len(r["answers_agnostic"]) == len(r["answers_aware"]) == 1 for r in rows)
    assert rows[0]["needle_aware"] == rows[0]["needle_agnostic"]  # the full cache: the same prompt, split or not


def test_smollm2_finds_the_needle_with_full_and_int4_caches_and_a_short_sink_window_loses_it():
    """The real model (the wheel setup installs) at 512 tokens: the full cache and int4 answer at both depths
    (as measured in BENCHMARKS.md), and a sink cache holding only the last 60 tokens cannot answer a needle
    150 or more tokens back. About a minute on two cores."""
    from hf_kvplus.resolve import load_model, load_text

    model, tokenizer = load_model("smollm2-135m")
    haystack = tokenizer(load_text("austen:prideprejudice")[:20000])["input_ids"]
    specs = [parse_cache_spec(s) for s in ("dynamic", "quantized:int4", "sink:4:60")]
    result = needle_grid(model, tokenizer, haystack, specs, [512], [0.3, 0.7], new_tokens=6)
    assert result.accuracy("dynamic") == 1.0
    assert result.accuracy("quantized:int4") == 1.0
    assert result.accuracy("sink:4:60") == 0.0


@pytest.fixture(scope="module")
def smollm2():
    from hf_kvplus.resolve import load_model, load_text

    model, tokenizer = load_model("smollm2-135m")
    return model, tokenizer, tokenizer(load_text("austen:prideprejudice")[:20000])["input_ids"]


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("depth", [0.0, 0.6])
def test_each_task_builds_a_prompt_of_the_asked_length_that_holds_its_answers(smollm2, name, depth):
    """With the real tokenizer and chat template: exactly `length` tokens, every expected answer in the prompt
    (the common words the most frequent of the list), and `score` takes the answers and refuses others."""
    import random

    _, tokenizer, haystack = smollm2
    task = retrieval_task(name)
    prompt = task.build(tokenizer, haystack, 700, depth, random.Random(3))
    assert prompt.ids.shape == (1, 700)
    text = tokenizer.decode(prompt.ids[0])
    assert all(answer in text for answer in prompt.expected) and len(set(prompt.expected)) == len(prompt.expected)
    if name == "cwe":
        counts = {word: text.count(f". {word} ") + text.count(f". {word}\n") for word in WORDS}
        assert min(counts[w] for w in prompt.expected) > max(c for w, c in counts.items() if w not in prompt.expected)
    else:
        assert tokenizer.decode(prompt.ids[0, prompt.at :]).lstrip().startswith(("The pass key", "One of", "VAR"))
    if name == "vartrack":  # a chain from the value through every name
        value = re.search(r"the value (\d+)", text).group(1)
        sources = [value, *prompt.expected[:-1]]
        assert all(f"VAR {n} = {s}." in text for n, s in zip(prompt.expected, sources, strict=True))
    assert task.score(" " + ", ".join(prompt.expected) + ".", prompt.expected)
    wrong = prompt.expected[:-1] + ["ZZZZZ" if name in ("vartrack", "cwe") else "99999"]  # the last one replaced
    assert not task.score(" " + ", ".join(wrong), prompt.expected)
    assert not task.score(" I do not know.", prompt.expected)


def test_an_unknown_task_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match="unknown retrieval task 'ruler'; known: passkey, multikey, multivalue"):
        retrieval_task("ruler")


def test_lossless_caches_answer_every_task_as_dynamic_does_and_the_summary_splits_by_task(local_model):
    _, _, tokenizer, model = local_model
    haystack = tokenizer(TEXT)["input_ids"]
    specs = [parse_cache_spec(s) for s in ("dynamic", "paged:block=16")]
    result = needle_grid(model, tokenizer, haystack, specs, [160], [0.3, 0.7], new_tokens=4,
                         tasks=[PassKey(), MultiKey()])  # fmt: skip
    assert result.tasks == ["passkey", "multikey"] and len(result.trials) == 2 * 2 * 2
    answers = {spec.text: [(t.task, t.depth, t.key, t.answer) for t in result.trials if t.cache == spec.text]
               for spec in specs}  # fmt: skip
    assert answers["dynamic"] == answers["paged:block=16"]
    row = result.summary()[0]
    for task in ("passkey", "multikey"):
        picked = [t.correct for t in result.trials if t.cache == "dynamic" and t.task == task]
        assert row[f"acc_{task}"] == sum(picked) / len(picked)
