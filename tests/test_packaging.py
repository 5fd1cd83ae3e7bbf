"""The distribution ships `kernels/` as `hf_kvplus.kernels` only, and Transformers is unaffected by it."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_kernels_ship_inside_hf_kvplus_only(tmp_path):
    out = run_python(
        "import importlib.util, hf_kvplus.kernels.decode_attention as m;"
        "print(importlib.util.find_spec('kernels'));"
        "print(m.__name__)",
        cwd=tmp_path,
    )
    assert out.split() == ["None", "hf_kvplus.kernels.decode_attention"]
    assert importlib.metadata.distribution("hf-kvplus").metadata["Name"] == "hf-kvplus"


def test_transformers_and_a_model_load_are_unaffected_from_the_repository_root(tmp_path):
    # From the repository root the `kernels/` folder is on the path (`python -c` puts the working
    # directory first); Transformers probes that name and must still see no kernels package.
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import is_kernels_available
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
AutoModelForCausalLM.from_config(config).save_pretrained({str(tmp_path)!r})
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
logits = model(torch.arange(5)[None]).logits
assert torch.isfinite(logits).all()
assert not is_kernels_available()
top = sys.modules.get('kernels')
assert top is None or not [n for n in vars(top) if not n.startswith('__')], vars(top)
import hf_kvplus
assert hf_kvplus.kernels.__name__ == 'hf_kvplus.kernels'
print('ok')
"""
    assert run_python(code, cwd=REPO).strip().endswith("ok")


def test_the_wheel_ships_every_module_and_no_top_level_kernels(tmp_path):
    """A non-editable install gets every module of the repository, `kernels/` under hf_kvplus only."""
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO), "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("hf_kvplus-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names} == {"hf_kvplus", wheel.name.split("-py")[0] + ".dist-info"}
    expected = {f"hf_kvplus/{p.relative_to(REPO / 'hf_kvplus')}" for p in (REPO / "hf_kvplus").rglob("*.py")}
    expected |= {f"hf_kvplus/kernels/{p.name}" for p in (REPO / "kernels").glob("*.py")}
    expected |= {f"hf_kvplus/kernels/{p.name}" for p in (REPO / "kernels").glob("*.cpp")}  # built on first use
    expected |= {f"hf_kvplus/{p.relative_to(REPO / 'hf_kvplus')}" for p in (REPO / "hf_kvplus" / "data").rglob("*.json")}
    assert expected - names == set()


def test_kernels_import_hf_kvplus_at_module_level_only():
    """No kernel module imports hf_kvplus inside a function: such an import hides a cycle. The device choice that
    needed them lives above the kernel modules, in kernels/dispatch.py (the layers: pyproject's import contracts)."""
    import ast

    found = []
    for path in sorted((REPO / "kernels").glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                    names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                    if (isinstance(node, ast.ImportFrom) and node.level) or any(n.startswith("hf_kvplus") for n in names):
                        found.append(f"{path.name}:{node.lineno}")
    assert not found, found
