"""`kvplus context save` then `kvplus context ask`, on a local model folder and text: the answers from the saved
cache, loaded once per question, are the answers the cache gives in the process that filled it."""

import json

import pytest
import torch
import word_model

from hf_kvplus import cache_kwargs
from hf_kvplus.cli import context as context_module
from hf_kvplus.cli import main
from hf_kvplus.cli.context import question_ids
from hf_kvplus.evicting_cache import EvictingCache
from hf_kvplus.resolve import load_model
from hf_kvplus.specs import parse_cache_spec

WORDS = "the special number of Lisbon Nairobi Osaka Quito Tromso Hanoi Dakar Perth Bergen Cusco is Remember What"
TEXT = " ".join(("It is a truth universally acknowledged that a single man in possession of a good fortune must be in "
                 "want of a wife " + WORDS).split() * 30)  # fmt: skip


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer trained on the text, saved as a local folder."""
    return word_model.local_model(tmp_path_factory, TEXT)


@pytest.mark.parametrize("spec", ["dense", "sink:4:60"])
def test_answers_from_the_saved_context_are_the_ones_the_filled_cache_gives(local_model, tmp_path, capsys, monkeypatch,
                                                                           spec):
    folder, text = local_model
    path = tmp_path / "ctx.kvcache"
    assert main(["context", "save", str(path), "--model", folder, "--text", text, "--tokens", "120", "--needles", "2",
                 "--cache", spec]) == 0  # fmt: skip
    sidecar = json.loads((tmp_path / "ctx.kvcache.json").read_text())
    assert len(sidecar["context"]) == 120 and len(sidecar["facts"]) == 2 and sidecar["cache"] == spec
    capsys.readouterr()
    loads = []

    def load_cache(*args, **kwargs):  # every question starts from the saved cache: the context seen, nothing more
        cache = real_load(*args, **kwargs)
        loads.append(cache.get_seq_length())
        return cache

    real_load = context_module.load_cache
    monkeypatch.setattr(context_module, "load_cache", load_cache)
    assert main(["context", "ask", str(path), "--model", folder, "--new-tokens", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[load")]
    assert loads == [120, 120]
    model, tokenizer = load_model(folder)
    context = torch.tensor([sidecar["context"]])
    for fact, line in zip(sidecar["facts"], lines, strict=True):
        cache = parse_cache_spec(spec).build(model.config, max_length=200)
        with torch.no_grad():
            model(context, **cache_kwargs(cache), logits_to_keep=1)
            ids = torch.cat([context, torch.tensor([question_ids(tokenizer, fact["question"], fact["answer_start"])])], 1)
            appending = cache.appending() if isinstance(cache, EvictingCache) else torch.no_grad()
            with appending:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=4,
                                     do_sample=False, pad_token_id=0)  # fmt: skip
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        assert line.split("-> ", 1)[1].startswith(f"{fact['answer_start']} {answer}"), (line, answer)
