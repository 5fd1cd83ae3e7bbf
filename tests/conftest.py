"""Test-wide setup.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a kernel, so it must be set before anything
imports hf_kvplus (and with it the kernel modules). This machine has no GPU: every Triton kernel in
the tests runs under the interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
