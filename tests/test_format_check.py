"""`check_formats` and `kvplus check-formats`: what a lossy cache costs the model at hand on the user's text, measured
against DynamicCache, with a verdict per spec against a threshold."""

import json

import pytest
import torch
import word_model
from transformers import DynamicCache

from conformance.models import build_model
from hf_kvplus.cli import main
from hf_kvplus.errors import ConfigError
from hf_kvplus.evaluation.format_check import check_format, check_formats
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.specs import parse_cache_spec

SPECS = ["quantized:int4", "quantized:k2v2"]
TOKENS = 256


@pytest.fixture(scope="module")
def gemma():
    """The tiny Gemma 3 (sliding and full layers: its family's layer formats apply) and 256 ids of a random text."""
    model = build_model("gemma3")
    return model, torch.randint(3, model.config.vocab_size, (TOKENS + 20,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def measured(gemma):
    model, ids = gemma
    return check_formats(model, ids, SPECS, threshold_pct=0.0, tokens=TOKENS, progress=False)


def test_each_cost_is_that_of_an_independent_pass_through_the_cache(gemma, measured):
    model, ids = gemma
    ids = ids[:TOKENS]
    reference = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=32, progress=False).perplexity
    for cost in measured.costs:
        cache = parse_cache_spec(cost.spec).build(model.config, max_length=TOKENS)
        mine = perplexity(model, ids, cache, chunk_size=32, progress=False).perplexity
        assert cost.delta_pct == pytest.approx(100 * (mine / reference - 1), abs=1e-3), cost.spec
        report = cache.quantized_report()
        assert cost.bits_per_coordinate == report["bits_per_coordinate"], cost.spec
        assert cost.family_defaults == report["family_defaults"], cost.spec
        assert cost.kl > 0 and cost.se_pct > 0 and cost.tokens == TOKENS
    assert measured.reference_perplexity == pytest.approx(reference, rel=1e-5)
    int4, k2v2 = measured.costs
    assert k2v2.family_defaults == "Gemma 3" and k2v2.kl > int4.kl  # 2-bit codes diverge more than 4-bit ones


def test_a_spec_over_the_threshold_is_flagged_and_one_within_it_is_not(gemma, measured):
    model, ids = gemma
    low, high = sorted(measured.costs, key=lambda cost: cost.delta_pct)
    assert high.delta_pct > low.delta_pct
    threshold = (low.delta_pct + high.delta_pct) / 2  # between two measured changes: either verdict can be wrong
    check = check_formats(model, ids, SPECS, threshold_pct=threshold, tokens=TOKENS, progress=False)
    assert [cost.spec for cost in check.over()] == [high.spec]
    by_spec = {cost.spec: cost for cost in check.costs}
    assert by_spec[high.spec].over and not by_spec[low.spec].over
    assert check.advice() == [f"{high.spec} costs {high.delta_pct:+.1f}% perplexity on this model and text "
                              f"(threshold {threshold:g}%): use {low.spec} ({low.delta_pct:+.1f}%)"]  # fmt: skip
    data = json.loads(check.to_json())
    assert data["over"] == [high.spec] and data["threshold_pct"] == threshold and data["tokens"] == TOKENS
    assert {row["spec"]: row["over"] for row in data["costs"]} == {high.spec: True, low.spec: False}
    table = check.to_markdown().splitlines()
    assert next(line for line in table if f"`{high.spec}`" in line).endswith("| over |")
    assert next(line for line in table if f"`{low.spec}`" in line).endswith("| within |")


def test_refusals_name_the_numbers(gemma):
    model, ids = gemma
    with pytest.raises(ConfigError, match=r"lossy caches; \['dynamic'\]"):
        check_formats(model, ids, ["quantized:int4", "dynamic"], tokens=TOKENS)
    with pytest.raises(ConfigError, match=rf"first 1024 tokens .* it holds {TOKENS + 20}"):
        check_formats(model, ids, SPECS)  # the default 1,024 tokens from a shorter text
    with pytest.raises(ConfigError, match=r"quantized:int4 holds the newest 128 tokens .* on 100 tokens"):
        check_formats(model, ids, SPECS, tokens=100)
    with pytest.raises(ConfigError, match="unknown cache 'quantised'"):
        check_formats(model, ids, ["quantised:int4"], tokens=TOKENS)
    with pytest.raises(ConfigError, match=r"k2v2 holds the newest 128 tokens .* on 100 tokens"):
        check_format(model, ids[:100], "k2v2")  # (`kvplus calibrate --check`)


TEXT = " ".join("a check on your own model and text before a preset is trusted with a long context".split() * 30)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    return word_model.local_model(tmp_path_factory, TEXT)


def test_cli_reports_with_status_0_and_fails_over_only_when_asked(local_model, tmp_path, capsys):
    folder, text = local_model
    args = ["check-formats", "--model", folder, "--text", text, "--tokens", "160",
            "--specs", "quantized:int8:window=16", "quantized:int2:window=16"]  # fmt: skip
    assert main([*args, "--threshold", "-1000", "--json", str(tmp_path / "check.json")]) == 0  # a report
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "check.json").read_text())
    assert data["over"] == ["quantized:int8:window=16", "quantized:int2:window=16"] and data["text"] == text
    assert data["tokens"] == 160 and data["command"] and data["versions"]
    assert "quantized:int2:window=16 costs" in out and "no spec checked is within it" in out
    assert main([*args, "--threshold", "-1000", "--fail-over"]) == 3
    assert main([*args, "--threshold", "1e9", "--fail-over"]) == 0
    assert "every spec is within the 1e+09% threshold" in capsys.readouterr().out
    assert main([*args, "--tokens", "10000"]) == 2  # a refused input, not a verdict
    assert "ConfigError" in capsys.readouterr().err


@pytest.mark.parametrize(("formats", "lossy"), [(["fp16", "k2v2"], True), (["int4"], True), (["fp16"], False)])
def test_the_planner_points_a_lossy_format_to_the_check(formats, lossy, capsys):
    assert main(["plan", "smollm2-135m", "--context", "4096", "--format", *formats]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (the notes are wrapped)
    assert ("SmolLM2-135M's unless they name another model" in out) == lossy
    assert ("kvplus check-formats --model MODEL --text YOUR_TEXT" in out) == lossy
