"""With hf_kvplus imported, Transformers' own caches and cache-free calls compute bit-identically."""

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent


def outputs(tmp_path, plugin: bool) -> dict:
    out = tmp_path / f"plugin-{plugin}.pt"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, str(HERE / "plugin_outputs.py"), str(out)] + (["--plugin"] if plugin else [])
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path)
    return torch.load(out)


def test_dynamic_static_and_no_cache_are_bit_identical_with_the_plugin(tmp_path):
    without, with_plugin = outputs(tmp_path, plugin=False), outputs(tmp_path, plugin=True)
    assert without.keys() == with_plugin.keys()
    assert {k.split("-")[1] for k in without} == {"sdpa", "eager"}
    assert {k.split("-")[2] for k in without} >= {"default", "dynamic", "static"}
    for key, value in without.items():
        assert torch.equal(value, with_plugin[key]), key
