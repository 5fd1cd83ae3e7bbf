"""The ahead-of-time compile gate (``kernels/aot.py``): every kernel compiles for a real GPU target, no GPU needed.

The interpreter runs of the other kernel tests accept code that a GPU build rejects; these tests
compile through triton's AOT path with the ptxas of the triton wheel. CI compiles the gate's covering
subset for sm_90 (each kernel with each constexpr value, pointer-type combination and option set at
least once: about 65 specializations, a minute and a half on 2 cores); the whole enumeration (about
1,000 specializations, tens of minutes on 2 cores) runs with ``-m slow``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from hf_kvplus.errors import ConfigError  # noqa: E402
from hf_kvplus.kernels import aot  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in ("triton.jit", "jit")


def _jit_functions() -> tuple[dict[str, set[str]], set[str]]:
    """Every @triton.jit function of kernels/*.py -> the names it calls; and those launched as ``fn[grid](...)``."""
    calls: dict[str, set[str]] = {}
    launched: set[str] = set()
    for path in sorted((REPO / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                calls[node.name] = {
                    c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                }
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                if isinstance(node.func.value, ast.Name):
                    launched.add(node.func.value.id)
    return calls, launched & set(calls)


def _assert_covers_every_jit_function(kernels: set[str]) -> None:
    """Every launched kernel is compiled by the gate, and every other @triton.jit function is called by one."""
    calls, launched = _jit_functions()
    assert launched, "found no kernel launches in kernels/*.py"
    assert launched <= kernels, f"kernels launched by the library but missing from the gate: {sorted(launched - kernels)}"
    covered, todo = set(), set(kernels)
    while todo:
        name = todo.pop()
        covered.add(name)
        todo |= (calls.get(name, set()) & set(calls)) - covered
    assert set(calls) <= covered, f"@triton.jit functions the gate never compiles: {sorted(set(calls) - covered)}"


def _run_gate(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hf_kvplus.kernels.aot", *args, "--json", str(out)],
        capture_output=True, text=True, timeout=3600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, f"gate failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def _assert_compiled(report: dict, target: str) -> None:
    rows = report["rows"]
    assert report["targets"] == [target]
    failed = [r for r in rows if r["status"] != "ok"]
    assert not failed, "\n".join(f"{r['kernel']} [{r['spec']}] {r['status']}: {r['error']}" for r in failed)
    for r in rows:
        assert r["registers"] > 0 and r["spill_stores"] is not None and r["spill_loads"] is not None, r
    _assert_covers_every_jit_function({r["kernel"] for r in rows})


def test_enumeration_reaches_every_jit_function_and_the_subset_every_feature():
    specs = aot.specializations()
    _assert_covers_every_jit_function({s.kernel for s in specs})
    assert len({s.key() for s in specs}) == len(specs)
    quick = aot.covering(specs)
    assert set().union(*(s.features() for s in quick)) == set().union(*(s.features() for s in specs))
    assert len(quick) < len(specs) // 5


def test_covering_subset_compiles_for_sm90(tmp_path):
    proc, report = _run_gate(tmp_path, "--arch", "sm_90", "--quick")
    _assert_compiled(report, "sm_90")
    assert report["quick"] and report["triton"]
    assert f"{len(report['rows'])} specializations: {len(report['rows'])} compiled" in proc.stdout


@pytest.mark.slow
def test_every_specialization_compiles_for_sm90(tmp_path):
    _, report = _run_gate(tmp_path, "--arch", "sm_90")
    _assert_compiled(report, "sm_90")
    assert len(report["rows"]) == len(aot.specializations())


def test_fp8_attention_needs_sm89_and_fp8_packing_compiles_on_sm80():
    """e4m3 codes are read with tl.float8e4nv (sm_89+); the pack kernels encode them with integers."""
    fp8 = [s for s in aot.specializations() if dict(s.choices).get("IS_FP8")]
    attention = [s for s in fp8 if s.kernel == "_quant_split_kernel"]
    packing = aot.covering([s for s in fp8 if s.kernel != "_quant_split_kernel"])
    assert attention and packing and all(s.min_arch == 0 for s in packing)
    forced = dataclasses.replace(attention[0], min_arch=0)  # the status is true: sm_80 rejects the type
    rows = aot.run([*attention, *packing, forced], [aot.parse_arch("sm_80")], jobs=2)
    assert {r.status for r in rows[: len(attention)]} == {"needs sm_89+"}
    assert all(r.status == "ok" and r.registers > 0 for r in rows[len(attention) : -1]), rows[len(attention) : -1]
    assert rows[-1].status == "error" and "fp8e4nv" in rows[-1].error


def test_unknown_arch_is_a_config_error(capsys):
    with pytest.raises(ConfigError, match="sm_42"):
        aot.parse_arch("sm_42")
    with pytest.raises(SystemExit) as exit_info:
        aot.main(["--arch", "sm_90", "sm_42"])
    assert exit_info.value.code == 2
    assert "unknown arch 'sm_42'" in capsys.readouterr().err
