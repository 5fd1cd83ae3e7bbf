"""The `seed` fixture: the same numbers every run of a test, different ones across tests, and a failing test's
report that names its seed."""

import re
from pathlib import Path

pytest_plugins = ["pytester"]

SEEDED = """
import torch

def test_one(seed):
    print("drew", repr(torch.rand(1).item()), "with", seed)
    assert False

def test_two(seed):
    print("drew", repr(torch.rand(1).item()), "with", seed)
    assert False
"""


def _run(pytester, *env):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_seeded=SEEDED)
    for name, value in env:
        pytester._monkeypatch.setenv(name, value)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--device", "cpu")
    text = result.stdout.str()
    drawn = re.findall(r"drew (\S+) with (\d+)", text)
    named = re.findall(r"this test drew seed (\d+): rerun it with KVPLUS_TEST_SEED=(\d+)", text)
    return drawn, named


def test_each_test_its_own_seed_named_on_failure_and_rerunning_with_it_draws_the_same_numbers(pytester):
    first, named = _run(pytester)
    assert len(first) == 2 and first[0] != first[1]  # each test its own seed and numbers
    assert [seed for seed, _ in named] == [seed for _, seed in first]
    assert all(seed == rerun for seed, rerun in named)
    seed = first[0][1]
    again, named = _run(pytester, ("KVPLUS_TEST_SEED", seed))
    assert again[0] == first[0]  # the named seed gives the failing test's numbers back
    assert {s for s, _ in named} == {seed}
