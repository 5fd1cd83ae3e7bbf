"""Test-wide setup.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a kernel, so it must be set before anything
imports hf_kvplus (and with it the kernel modules). This machine has no GPU: every Triton kernel in
the tests runs under the interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def seed():
    """A fresh random seed per test, returned so failures can name it."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    return s


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every floating torch.empty made during the test starts as NaN, so unwritten output shows."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
