"""eval/compare_turboquant.py and eval/compare_tiny_turboquant.py stay runnable: each `--dry-run` (300 tokens of
SmolLM2-135M, chunks of 16 and 64) with hf_kvplus's rows alone in this venv, and with the other library's rows in its
own venv (`bash scripts/reference_venv.sh turboquant|tiny-turboquant`) where it is there: `TURBOQUANT_PYTHON` /
`TINY_TURBOQUANT_PYTHON`, or `.venv-turboquant` / `.venv-tiny-turboquant` at the top of the repository (the scripts'
default folders). A few seconds each.
"""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def other_python(variable: str, folder: str, library: str) -> str:
    """The python of another library's venv, or a skip that says how to make it."""
    python = os.environ.get(variable) or str(ROOT / folder / "bin" / "python")
    if not Path(python).exists():
        pytest.skip(f"no {folder} venv ({variable} unset): `bash scripts/reference_venv.sh {library} {folder}` makes it")
    return python


def dry_run(python: str, script: str, out: Path, *options: str) -> dict:
    done = subprocess.run([python, str(ROOT / "eval" / script), "--dry-run", "--out", str(out), *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    name = script.removeprefix("compare_").removesuffix(".py")
    assert {p.name for p in out.iterdir()} == {"runs.jsonl", f"{name}.json", f"{name}.md", f"{name}.png"}
    return json.loads((out / f"{name}.json").read_text())


def cells(result: dict) -> dict:
    return {(r["series"], r["config"], r["chunk"]): r for r in result["runs"]}


def test_compare_turboquant_dry_run_of_hf_kvplus_rows(tmp_path):
    result = dry_run(
        sys.executable, "compare_turboquant.py", tmp_path, "--ours-only", "--configs", "k4v2", "k3v2+mse"
    )
    got = cells(result)
    assert set(got) == {
        (s, c, k) for k in (16, 64) for s, c in (("DynamicCache", "dynamic"), ("hf_kvplus", "k4v2"))
    }
    ours = got[("hf_kvplus", "k4v2", 64)]
    assert ours["seed"] == 0 and ours["bits_per_coordinate"] > 3.25  # the preset's 4 exact first tokens count
    assert abs(ours["delta_pct"]) < 10


def test_compare_turboquant_dry_run_with_the_reference(tmp_path):
    python = other_python("TURBOQUANT_PYTHON", ".venv-turboquant", "turboquant")
    got = cells(dry_run(python, "compare_turboquant.py", tmp_path, "--configs", "k3v2", "k3v2+mse"))
    cache, once = (
        got[("turboquant-torch cache", "k3v2", 64)],
        got[("turboquant-torch MSE keys, coded once", "k3v2", 64)],
    )
    assert cache["bits_per_coordinate"] == 2.5 + 24 / 64 and once["bits_per_coordinate"] == 2.5 + 16 / 64
    assert result_has_version(tmp_path / "turboquant.json", "turboquant-torch")


def test_the_reference_rows_are_turboquant_own_cache_built_by_from_model():
    """k3v2's reference row is `TurboQuantDynamicCache.from_model(model, bit_width=2)` (keys get a bit more on a GQA
    model) compressed after every forward, to the last digit: the rows change only the bit widths it passes."""
    python = other_python("TURBOQUANT_PYTHON", ".venv-turboquant", "turboquant")
    code = """
import sys; sys.path.insert(0, "eval")
import torch
from compare_turboquant import literal_cache, reference_cache
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.resolve import load_model, load_text
torch.set_num_threads(1)
model, tokenizer = load_model("smollm2-135m")
ids = tokenize(tokenizer, load_text("austen:prideprejudice"), 200)
ours = perplexity(model, ids, reference_cache(model.config, 3, 2, 32), chunk_size=32, progress=False).perplexity
theirs = perplexity(model, ids, literal_cache(model, 2, 32), chunk_size=32, progress=False).perplexity
print(ours, theirs)
assert ours == theirs, (ours, theirs)
"""
    done = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def result_has_version(path: Path, name: str) -> bool:
    return name in json.loads(path.read_text())["versions_other"]


def test_compare_tiny_turboquant_dry_run_of_hf_kvplus_rows(tmp_path):
    got = cells(dry_run(sys.executable, "compare_tiny_turboquant.py", tmp_path, "--ours-only", "--configs", "k4v4",
                        "tiny:aggressive"))  # fmt: skip
    assert set(got) == {
        (s, c, k) for k in (16, 64) for s, c in (("DynamicCache", "dynamic"), ("hf_kvplus", "k4v4"))
    }
    assert got[("hf_kvplus", "k4v4", 16)]["bits_per_coordinate"] == 4.25  # no preset first tokens for k4v4


def test_compare_tiny_turboquant_dry_run_with_tiny_turboquant(tmp_path):
    """Its presets' bits as its docstring counts them, a protected layer pair at float32; and its cache still needs
    the shim for Transformers 5.24's `update(..., kwargs=...)` (when this fails, drop the shim)."""
    python = other_python("TINY_TURBOQUANT_PYTHON", ".venv-tiny-turboquant", "tiny-turboquant")
    got = cells(dry_run(python, "compare_tiny_turboquant.py", tmp_path, "--configs", "tiny:safe", "tiny:aggressive",
                        "tiny:k4v2+protect1"))  # fmt: skip
    bits = {
        c: got[("tiny-turboquant", c, 64)]["bits_per_coordinate"]
        for c in ("safe", "aggressive", "k4v2+protect1")
    }
    assert bits["safe"] == (4 + 0.25 + 4 + 0.5) / 2 and bits["aggressive"] == (3 + 0.25 + 2 + 1) / 2
    assert bits["k4v2+protect1"] == pytest.approx((28 * (4 + 0.25 + 2 + 0.5) / 2 + 2 * 32) / 30)
    code = """
import torch
from tiny_turboquant import TinyKVCache
from hf_kvplus.resolve import load_model
model, _ = load_model("smollm2-135m")
try:
    model(input_ids=torch.tensor([[1, 2, 3]]), cache=TinyKVCache.for_model(model, compression="safe"))
except TypeError as error:
    assert "kwargs" in str(error), error
    print("still needs the shim")
else:
    raise SystemExit("TinyKVCache takes update(..., kwargs=...) now: drop the shim in compare_tiny_turboquant.py")
"""
    done = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-500:]


def test_lowbit_regions_dry_run_records_each_runs_standard_error(tmp_path):
    """A run's change comes with its paired standard error, from DynamicCache's per-token values kept beside it."""
    done = subprocess.run([sys.executable, str(ROOT / "eval" / "lowbit_regions.py"), "--dry-run", "--out", str(tmp_path),
                           "--texts", "austen:prideprejudice", "--configs", "k4v2", "--firsts", "4", "--boundaries", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    (row,) = [r for r in runs if r["config"] == "k4v2"]
    base = json.loads(gzip.decompress((tmp_path / "dynamic_nll.json.gz").read_bytes()))
    assert list(base) == ["austen:prideprejudice c32 t300"] and len(base["austen:prideprejudice c32 t300"]) == 299
    assert 0 < row["se_pct"] < 1  # k4v2 moves each token's log-likelihood by a few hundredths


def test_standard_error_is_the_paired_differences_spread_over_root_count(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "eval"))
    import torch
    from lowbit_regions import standard_error

    # differences +1, -1, +1, -1: sample standard deviation sqrt(4 / 3), over sqrt(4)
    assert standard_error(torch.tensor([2.0, 0.0, 3.0, 1.0]), [1.0, 1.0, 2.0, 2.0]) == pytest.approx((4 / 3) ** 0.5 / 2)
