"""The one-command GPU pass (scripts/gpu_pass.sh): its report, and the whole pass as a CPU dry run.

The dry run is every step of the pass at tiny sizes on the CPU (Triton kernels under the interpreter), so
the scripts a lent GPU will run cannot rot between GPUs: a step that breaks here fails CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "eval" / "gpu_pass_report.py"
#: The dry run's steps: the default list, with the batch-8 shares (e2e-b8, compile-b8: what a lease's 10-minute calls
#: run) in place of the batch-1 share and the whole compile step: each is the same script at another batch size (the
#: options are checked by parse-args below), and running both sizes cost the dry run about 50 s of CI's time.
STEPS = ["env", "tests", "aot", "kernels", "e2e-b8", "offload", "compile-b8"]
#: What the compile step must compare: every cache that declares is_compileable, and StaticCache.
GPU_PASS_COMPILE_SPECS = {
    "static", "dense:compile=on", "paged:compile=on", "quantized:int4:compile=on", "sink:4:4092:compile=on",
    "h2o:4096:compile=on",
}

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4">
<testcase classname="tests.test_a" name="test_ok"/>
<testcase classname="tests.test_a" name="test_ok2"/>
<testcase classname="tests.test_a" name="test_bad"><failure message="AssertionError: rel err 3e-2 | over 1e-2">tb</failure></testcase>
<testcase classname="tests.test_a" name="test_skip"><skipped message="no"/></testcase>
</testsuite></testsuites>
"""


def report(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPORT), *map(str, args)], capture_output=True, text=True)


def write_steps(folder: Path, *rows: tuple[str, int, int, int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "steps.tsv").write_text("".join("\t".join(map(str, row)) + "\n" for row in rows))


def test_report_counts_tests_and_says_which_steps_failed_or_timed_out(tmp_path):
    run = tmp_path / "run"
    write_steps(run, ("env", 0, 5, 60), ("tests", 1, 100, 360), ("kernels", 124, 240, 240))
    (run / "tests.xml").write_text(JUNIT)
    (run / "env.json").write_text(json.dumps({"gpu": {"name": "NVIDIA H100 80GB HBM3"}, "date": "2026-11-23"}))
    (run / "env.md").write_text("## Environment\n\n- device: NVIDIA H100\n")
    (run / "kernels.json").write_text(json.dumps({"rows": [{"kernel": "dense"}]}))
    result = report(run, "--out", tmp_path / "merged")
    assert result.returncode == 1, result.stdout + result.stderr
    merged = json.loads((tmp_path / "merged" / "gpu_pass.json").read_text())
    tests = merged["tests"]
    assert (tests["tests"], tests["passed"], tests["failures"], tests["skipped"]) == (4, 2, 1, 1)
    assert tests["failed"] == [
        {"test": "tests.test_a::test_bad", "kind": "failure", "message": "AssertionError: rel err 3e-2 | over 1e-2"}
    ]
    assert merged["kernels"]["rows"] == [{"kernel": "dense"}]
    md = (tmp_path / "merged" / "gpu_pass.md").read_text()
    assert md.startswith("# GPU pass: NVIDIA H100 80GB HBM3, 2026-11-23")
    assert "| env | 0 | 5 | 60 | ok |" in md
    assert "| tests | 1 | 100 | 360 | FAILED |" in md
    assert "| kernels | 124 | 240 | 240 | timed out |" in md
    assert "2 passed, 1 failed, 0 errors, 1 skipped, of 4" in md
    assert "over 1e-2" in md and "3e-2 / over" in md  # the table's cell separator is escaped
    assert "## Environment" in md


def test_report_without_the_env_step_names_the_device_of_a_step_s_stamp(tmp_path):
    run = tmp_path / "run"
    write_steps(run, ("kernels", 0, 90, 240))
    stamp = {"machine": "vm: NVIDIA H200, 16 cores, torch threads 2", "date": "2026-11-26T04:45:40+00:00"}
    (run / "kernels.json").write_text(json.dumps({**stamp, "rows": []}))
    result = report(run, "--out", tmp_path / "merged")
    assert result.returncode == 0, result.stdout + result.stderr
    md = (tmp_path / "merged" / "gpu_pass.md").read_text()
    assert md.startswith("# GPU pass: NVIDIA H200, 2026-11-26T04:45:40+00:00")


def test_report_takes_each_step_from_the_last_folder_that_ran_it(tmp_path):
    first, second = tmp_path / "call1", tmp_path / "call2"
    write_steps(first, ("env", 0, 5, 60), ("kernels", 1, 30, 240))
    (first / "env.json").write_text(json.dumps({"gpu": {"name": "first"}}))
    write_steps(second, ("kernels", 0, 90, 240))
    (second / "kernels.json").write_text(json.dumps({"rows": [{"kernel": "int4"}]}))
    result = report(first, second, "--out", tmp_path / "merged")
    assert result.returncode == 0, result.stdout + result.stderr
    merged = json.loads((tmp_path / "merged" / "gpu_pass.json").read_text())
    assert [(s["step"], s["rc"]) for s in merged["steps"]] == [("env", 0), ("kernels", 0)]
    assert merged["kernels"]["rows"] == [{"kernel": "int4"}]
    assert merged["env"]["gpu"]["name"] == "first"


def test_report_with_no_steps_fails(tmp_path):
    (tmp_path / "empty").mkdir()
    assert report(tmp_path / "empty", "--out", tmp_path / "merged").returncode == 1


def test_options_beside_gpu_pass_replace_its_own(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "eval"))
    import bench_compile

    whole = bench_compile.parse_args(["--out", "x", "--gpu-pass"])
    assert whole.batch == [1, 8] and set(whole.specs) == GPU_PASS_COMPILE_SPECS and whole.device == "cuda"
    share = bench_compile.parse_args(["--out", "x", "--gpu-pass", "--batch=8", "--specs", "static", "h2o:4096:compile=on"])
    assert share.batch == [8] and share.specs == ["static", "h2o:4096:compile=on"]
    assert (share.contexts, share.mode, share.device) == (whole.contexts, whole.mode, whole.device)
    import bench_e2e_gpu  # e2e-b1 and e2e-b8: one script, the batch size its only difference

    one, eight = (bench_e2e_gpu.parse_args(["--out", "x", "--batch", b]) for b in ("1", "8"))
    assert (one.batch, eight.batch) == ([1], [8]) and (one.context, one.specs) == (eight.context, eight.specs)


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_dry_run_of_the_whole_pass_on_the_cpu(tmp_path):
    out = tmp_path / "pass"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    env["KVPLUS_VENV"] = str(Path(sys.executable).parents[1])  # this interpreter's environment
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_pass.sh"), "--dry-run", "--out", str(out), *STEPS],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500,
    )
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:] + logs
    merged = json.loads((out / "gpu_pass.json").read_text())
    assert [s["step"] for s in merged["steps"]] == STEPS
    assert all(s["rc"] == 0 for s in merged["steps"]), merged["steps"]
    assert merged["env"]["bandwidth"]["copy_gb_per_s"] > 0
    assert merged["tests"]["passed"] > 0 and merged["tests"]["failures"] == merged["tests"]["errors"] == 0
    kernels = {row["kernel"] for row in merged["kernels"]["rows"]}
    assert kernels == {"sdpa (enable_gqa)", "dense", "dense+mass", "paged", "int8", "int4", "int2", "fp8", "k4v2", "k3v2",
                       "k2v2"}
    assert all(row["ok"] for row in merged["kernels"]["rows"] if "ok" in row)
    rows = merged["e2e_b8"]["rows"]
    assert rows[0]["cache"] == "dynamic" and len(rows) == 15 and {r["batch"] for r in rows} == {8}
    assert [r["cache"] for r in rows if "error" in r] == [], rows
    lossless = [r for r in rows if r["lossless"]]
    assert lossless and all(r["same_tokens"] for r in lossless), [(r["cache"], r.get("same_tokens")) for r in rows]
    assert {row["cache"] for row in merged["offload"]["rows"]} >= {"OffloadedCache dense", "OffloadedCache int4"}
    compiled = merged["compile-b8/compile"]["rows"]
    assert {(r["batch"], r["cache"]) for r in compiled} == {(8, c) for c in GPU_PASS_COMPILE_SPECS}
    assert all(r["compiled"] == "yes" and r["decode_ms"] > 0 for r in compiled), compiled
    md = (out / "gpu_pass.md").read_text()
    for section in ("## Environment", "## Tests on CUDA", "## Kernels compiled ahead of time",
                    "## Decode-attention kernels", "## End to end", "## Offloaded KV caches",
                    "## Compiled decode against StaticCache"):
        assert section in md


def test_report_summarizes_each_share_of_the_tests_on_its_own(tmp_path):
    # A short lease runs tests-syncs and tests-kernels (scripts/gpu_pass.sh): each share's JUnit file, under its name.
    run = tmp_path / "run"
    write_steps(run, ("tests-syncs", 0, 40, 120), ("tests-kernels", 124, 65, 65))
    (run / "tests-syncs.xml").write_text(JUNIT)
    result = report(run, "--out", tmp_path / "merged")
    assert result.returncode == 1, result.stdout + result.stderr
    merged = json.loads((tmp_path / "merged" / "gpu_pass.json").read_text())
    assert (merged["tests-syncs"]["tests"], merged["tests-syncs"]["failures"]) == (4, 1)
    assert merged["tests-kernels"] is None and "tests" not in merged
    md = (tmp_path / "merged" / "gpu_pass.md").read_text()
    assert "## Tests on CUDA (tests-syncs)\n\n2 passed, 1 failed" in md
    assert "## Tests on CUDA (tests-kernels)\n\nno JUnit file was written" in md
    assert "| tests-kernels | 124 | 65 | 65 | timed out |" in md
