"""Disk faults in an offloaded cache's disk tier: a full disk never splits a forward, a bad file is never trusted.

What `Offloaded(host_budget=..., folder=...)` promises, checked here against DynamicCache on a tiny random Llama:

- a write that fails (full disk) leaves every layer holding the same tokens: a layer the tier cannot write stays
  in host memory, the forward finishes, and `DiskTierError` (naming the bytes it needed and the bytes free) is
  raised when the next forward starts, before any layer changes; once space is freed, running that forward again
  continues, and the whole greedy run gives DynamicCache's tokens;
- a spill file that was truncated or altered is a typed error (`CorruptFileError`, naming the file, the expected
  and found length or checksum) when it is read back, never a signal (SIGBUS) or NaN logits; the cache then
  refuses every later use with that error until `reset()`.

The faults are injected (a writer that fails with ENOSPC from its k-th file on), and also made real on a 256 KiB
tmpfs where this process may mount one (root, with the capability to mount).
"""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_kvplus.placement.disk as disk_module
from hf_kvplus import DiskTierError, KVPlusError, OffloadedCache, cache_kwargs
from hf_kvplus.errors import CorruptFileError

LAYERS = 4
PROMPT = 40  # the 64-token buffers grow at the 25th generated token: every layer's files are rewritten whole
STEPS = 40
pytestmark = pytest.mark.usefixtures("on_cpu")


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    with torch.device("cpu"):
        return LlamaForCausalLM(tiny_config()).eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 96, (2, PROMPT), generator=torch.Generator().manual_seed(1), device="cpu")


@pytest.fixture(scope="module")
def expected(model, prompt):
    """DynamicCache's greedy tokens: what every run here must give."""
    return greedy(model, prompt, DynamicCache(config=model.config))[0]


def lengths(cache) -> list[int]:
    return [cache.get_seq_length(i) for i in range(LAYERS)]


def greedy(model, prompt, cache, steps: int = STEPS, on_fault=None):
    """Greedy decoding one forward at a time. A `DiskTierError` is handed to `on_fault(error, length_before)`,
    which frees space; the same forward then runs again. Returns the tokens and the faults seen."""
    tokens, faults, step_input = [], [], prompt
    with torch.no_grad():
        while len(tokens) < steps:
            before = cache.get_seq_length()
            try:
                logits = model(step_input, **cache_kwargs(cache)).logits
            except DiskTierError as error:
                if on_fault is None or len(faults) >= 10:
                    raise
                faults.append((len(tokens), before, lengths(cache), str(error)))
                on_fault(error, before)
                continue
            assert torch.isfinite(logits).all(), f"step {len(tokens)}: non-finite logits"
            step_input = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(step_input)
    return torch.cat(tokens, dim=1), faults


class FullDisk:
    """A writer that fails with ENOSPC from its `k`-th file (counted from 1) on, until `free()`."""

    def __init__(self, k: int | None):
        self.k, self.writes, self.full, self.freed = k, 0, False, False

    def open(self, file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            self.writes += 1
            if self.k is not None and self.writes >= self.k and not self.freed:
                self.full = True
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return builtins.open(file, mode, *args, **kwargs)

    def free(self, *_):
        self.freed = True


def writes_per_run(model, prompt, tmp_path, monkeypatch) -> list[int]:
    """Files the disk tier writes at each forward of a fault-free run (prefill first)."""
    counter = FullDisk(None)
    monkeypatch.setattr(disk_module, "open", counter.open, raising=False)
    cache = OffloadedCache(model.config, host_budget=0, folder=tmp_path / "count")
    per_forward = []
    original = model.forward

    def counting(*args, **kwargs):
        before = counter.writes
        out = original(*args, **kwargs)
        per_forward.append(counter.writes - before)
        return out

    monkeypatch.setattr(model, "forward", counting)
    greedy(model, prompt, cache)
    monkeypatch.undo()
    cache.close()
    return per_forward


def test_the_fault_points_cover_prefill_and_a_decode_step_that_rewrites_every_layer(model, prompt, tmp_path,
                                                                                    monkeypatch):
    """The k values below land mid-forward: the prefill spills 2 files per layer as the next layer is updated (the
    last layer's as the next forward starts), and the decode step whose tokens outgrow the 64-token buffers rewrites
    every layer's 2 files the same way; the other decode steps write in place."""
    per_forward = writes_per_run(model, prompt, tmp_path, monkeypatch)
    grown = 64 - PROMPT + 1  # the forward of the 25th generated token
    assert per_forward[:2] == [2 * (LAYERS - 1), 2], per_forward
    assert per_forward[grown : grown + 2] == [2 * (LAYERS - 1), 2], per_forward
    assert sum(per_forward) == 4 * LAYERS, per_forward


# k: the first failing file. 1..6 fail during the prefill (layer 0's keys, layer 1's values, layer 2's values), 7..8
# as the first decode step starts (the last layer's); 9..14 during the decode step that rewrites every layer (layer
# 0's keys and values, layer 1's values, layer 2's values), 15..16 as the step after it starts.
@pytest.mark.parametrize("k", [1, 4, 6, 7, 9, 10, 12, 14, 16])
def test_a_full_disk_at_any_write_leaves_the_layers_as_one_and_a_retry_gives_dynamic_tokens(
    model, prompt, expected, tmp_path, monkeypatch, k
):
    """Promise: a full disk never splits a forward. At every `DiskTierError` all layers hold the same number of
    tokens, the number they held before the failed call (nothing changed), and the message names the bytes needed
    and free; after `free()` the same forward runs again and the greedy run equals DynamicCache's."""
    disk = FullDisk(k)
    monkeypatch.setattr(disk_module, "open", disk.open, raising=False)
    cache = OffloadedCache(model.config, host_budget=0, folder=tmp_path)
    tokens, faults = greedy(model, prompt, cache, on_fault=disk.free)
    assert disk.full and faults, "the injected fault never surfaced"
    for step, before, seen, message in faults:
        assert seen == [before] * LAYERS, f"step {step}: layers hold {seen}, {before} each before the forward"
        assert "No space left on device" in message
        assert _names_bytes(message), message
    assert torch.equal(tokens, expected)
    assert lengths(cache) == [PROMPT + STEPS - 1] * LAYERS
    assert cache.tier_bytes().host == 0, "layers that stayed in host memory were not spilled once space was freed"


def _names_bytes(message: str) -> bool:
    import re

    return re.search(r"\d+ bytes .*\d+ bytes are free", message) is not None


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (needs root and the right to mount); skipped where this process may not mount one."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the injected full disk above covers the same paths)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); the injected full disk "
                    "covers the same paths")  # fmt: skip
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_real_full_tmpfs_mid_decode_keeps_the_layers_as_one_and_a_retry_gives_dynamic_tokens(
    model, prompt, small_tmpfs
):
    """Promise, on a real file system: a 256 KiB tmpfs filled by a ballast file so that the decode step that
    rewrites every layer runs out of space part-way; the error comes with every layer at the same length, and once
    the ballast is deleted the run continues to DynamicCache's tokens (one batch row: 192 KiB of files at the end)."""
    prompt = prompt[:1]
    expected = greedy(model, prompt, DynamicCache(config=model.config))[0]
    ballast = small_tmpfs / "ballast"
    cache = OffloadedCache(model.config, host_budget=0, folder=small_tmpfs)
    state = {}

    def fill(cache_bytes: int):
        # The rewrite needs 3x the prompt's files (192-token buffers instead of 64): leave room for about half.
        free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
        with open(ballast, "wb") as f:
            f.write(b"\0" * max(0, free - cache_bytes))
        state["filled"] = True

    def free(error, before):
        ballast.unlink(missing_ok=True)

    original = cache.placement.begin

    def begin():
        if "filled" not in state and cache.get_seq_length() > PROMPT:
            fill(cache.tier_bytes().disk)
        original()

    cache.placement.begin = begin
    tokens, faults = greedy(model, prompt, cache, on_fault=free)
    assert faults, "the tmpfs never filled"
    for step, before, seen, message in faults:
        assert seen == [before] * LAYERS, f"step {step}: layers hold {seen}, {before} each before the forward"
        assert _names_bytes(message), message
    assert torch.equal(tokens, expected)
    cache.close()


def _corrupt_case(action: str) -> str:
    """A script that fills a disk-tier cache, damages one of layer 1's files (`action`), runs three more decode
    steps and prints what happened: `typed <class>: <message>`, or `nan`, `wrong` or `same` (the logits against
    DenseCache's: the same attention path, bit for bit)."""
    return textwrap.dedent(
        f"""
        import os, sys, torch
        from pathlib import Path
        from transformers import LlamaConfig, LlamaForCausalLM
        from hf_kvplus import DenseCache, KVPlusError, OffloadedCache, cache_kwargs
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers={LAYERS},
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 96, (2, {PROMPT}), generator=torch.Generator().manual_seed(1))
        cache, reference = OffloadedCache(config, host_budget=0, folder=sys.argv[1]), DenseCache(config)
        with torch.no_grad():
            for c in (cache, reference):
                model(ids, **cache_kwargs(c))
                model(ids[:, -1:], **cache_kwargs(c))
            entry = cache.placement._rest(cache.layers[1].storage).files["keys"]
            path = Path(getattr(entry, "path", entry))
            size = path.stat().st_size
            {action}
            try:
                for step in range(3):
                    logits = model(ids[:, -1:], **cache_kwargs(cache)).logits
                    expected = model(ids[:, -1:], **cache_kwargs(reference)).logits
            except KVPlusError as e:
                print("typed", type(e).__name__ + ":", e, flush=True)
                sys.exit(0)
            print("nan" if not torch.isfinite(logits).all() else "same" if torch.equal(logits, expected) else "wrong")
        """
    )


def _run_case(action: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _corrupt_case(action), str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip


def test_a_truncated_spill_file_is_a_typed_error_not_a_signal(tmp_path):
    """Promise: a spill file cut short on disk is refused when read back, with a typed error naming the file, the
    length expected and the length found; the process lives (run in a subprocess so that a SIGBUS shows as one)."""
    done = _run_case("os.truncate(path, size // 2)", tmp_path)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("typed CorruptFileError:"), done.stdout + done.stderr[-2000:]
    assert "-keys.kv" in done.stdout and "bytes" in done.stdout, done.stdout


def test_a_spill_file_truncated_while_its_layer_is_in_use_is_rewritten_not_a_signal(tmp_path):
    """Promise: a file cut short while its layer is in use (between the read and the write-back of the step's
    token) is found before the write-back writes into its mapping (no SIGBUS) and rewritten whole from the working
    copy, which holds every byte of it, with a RuntimeWarning naming it; the next steps read it back checked and
    give DenseCache's logits (DynamicCache's attention path differs in the last bits)."""
    action = textwrap.dedent(
        """
        placement = cache.placement
        acquire = placement.acquire
        def cutting(storage):
            acquire(storage)
            if storage is cache.layers[1].storage and path.exists():
                os.truncate(path, size // 2)
        placement.acquire = cutting
        """
    ).strip().replace("\n", "\n            ")
    done = _run_case(action, tmp_path)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout == "same\n", done.stdout + done.stderr[-2000:]
    assert "RuntimeWarning" in done.stderr and "-keys.kv is no longer" in done.stderr, done.stderr[-2000:]


@pytest.fixture
def filled(model, prompt, tmp_path):
    """A disk-tier cache after a prefill and one decode step, every layer in files, and the DenseCache twin."""
    cache = OffloadedCache(model.config, host_budget=0, folder=tmp_path)
    with torch.no_grad():
        model(prompt, **cache_kwargs(cache))
        model(prompt[:, -1:], **cache_kwargs(cache))
    return cache


def _spill_path(cache, layer: int, name: str = "keys") -> Path:
    entry = cache.placement._rest(cache.layers[layer].storage).files[name]
    return Path(getattr(entry, "path", entry))


def test_a_spill_file_of_random_bytes_is_a_typed_error_not_nan(model, prompt, tmp_path):
    """Promise: a spill file overwritten with other bytes of the same length is refused when read back
    (`CorruptFileError` naming the file and both checksums), never attended to (NaN or wrong logits)."""
    filled = OffloadedCache(model.config, host_budget=0, folder=tmp_path)
    with torch.no_grad():
        model(prompt, **cache_kwargs(filled))
        model(prompt[:, -1:], **cache_kwargs(filled))
    path = _spill_path(filled, 2)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(torch.full((size,), 0xFF, dtype=torch.uint8).numpy().tobytes())  # NaN as float32, every value
    with torch.no_grad(), pytest.raises(CorruptFileError, match=rf"{path.name}.*XXH3-64 checksum"):
        logits = model(prompt[:, -1:], **cache_kwargs(filled)).logits
        pytest.fail(f"read back unchecked: logits finite: {bool(torch.isfinite(logits).all())}")


def test_a_cache_with_a_corrupt_file_refuses_every_use_until_reset(model, prompt, expected, filled):
    """Promise: after a corrupt file the cache is not whole (its data is gone), so every later use raises the same
    `CorruptFileError` (a forward, crop, a beam reorder, reading a layer's keys); `reset()` empties it and it serves
    a new prompt as DynamicCache does."""
    path = _spill_path(filled, 1, "values")
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\x12\x34\x56\x78")
    with torch.no_grad():
        with pytest.raises(CorruptFileError):
            model(prompt[:, -1:], **cache_kwargs(filled))
        uses = {
            "forward": lambda: model(prompt[:, -1:], **cache_kwargs(filled)),
            "crop": lambda: filled.crop(-1),
            "reorder": lambda: filled.reorder_cache(torch.tensor([1, 0])),
            "keys": lambda: filled.layers[3].keys,
        }
        for what, use in uses.items():
            with pytest.raises(CorruptFileError, match=path.name):
                use()
                pytest.fail(f"{what} ran on a cache with a corrupt file")
    filled.reset()
    tokens, _ = greedy(model, prompt, filled)
    assert torch.equal(tokens, expected)


def test_errors_are_typed():
    assert issubclass(CorruptFileError, KVPlusError) and not issubclass(CorruptFileError, DiskTierError)
