"""Offloaded caches whose layers rest in the disk tier's files, saved with `cache.save` and loaded with `load_cache`.

The saved file holds the disk layers' bytes, each file read back checked as the save runs; a loaded copy writes those
layers to files of its own tier (the saved records name the original's files, never touched) and continues with
the same logits as the original, even once the original's files are gone. A file of the tier cut short or altered
before the save is a `CorruptFileError` and nothing is written; a load onto a full disk is a `DiskTierError`.
"""

from __future__ import annotations

import builtins
import errno

import pytest
import torch
from test_persist_cache import PROMPT, decode_tokens, prompt_ids, step

import hf_kvplus.placement.disk as disk_module
from conformance.models import get_model
from hf_kvplus import DiskTierError, H2OCache, OffloadedCache, PagedCache, cache_kwargs, load_cache
from hf_kvplus.errors import CorruptFileError
from hf_kvplus.placement.offloaded import Offloaded


def layer_bytes(config) -> int:
    """Bytes of one layer of the tiny Llama's dense cache after the prompt (its buffers' capacity)."""
    cache = OffloadedCache(config)
    with torch.no_grad():
        get_model("llama")(prompt_ids(), **cache_kwargs(cache))
    return cache.tier_bytes().host // len(cache.layers)


BUILDERS = {
    "dense, every layer on disk": lambda config, folder: OffloadedCache(config, host_budget=0, folder=folder),
    "dense, one layer in host memory": lambda config, folder: OffloadedCache(
        config, host_budget=layer_bytes(config), folder=folder
    ),
    "int4 codes on disk": lambda config, folder: OffloadedCache(config, bits=4, window=16, host_budget=0, folder=folder),
    "k4v2 codes on disk": lambda config, folder: OffloadedCache(
        config, bits="k4v2", window=16, host_budget=0, folder=folder
    ),
    "paged blocks on disk": lambda config, folder: PagedCache(
        config, block_size=8, placement=Offloaded(host_budget=0, folder=folder)
    ),
    "H2O slots on disk": lambda config, folder: H2OCache(
        config, budget=32, placement=Offloaded(host_budget=0, folder=folder)
    ),
}


def filled(name, folder):
    model = get_model("llama")
    cache = BUILDERS[name](model.config, folder)
    with torch.no_grad():
        step(model, cache, prompt_ids())
    return model, cache


@pytest.mark.parametrize("name", BUILDERS)
def test_a_cache_on_disk_loads_into_its_own_files_and_continues_after_the_original_is_gone(name, tmp_path):
    model, cache = filled(name, tmp_path / "tier")
    assert cache.tier_bytes().disk > 0 and cache.placement.disk.files()
    path = cache.save(tmp_path / "cache.safetensors")
    on_disk = cache.tier_bytes().disk  # (the save put the layer in use since the prompt back at rest)
    with torch.no_grad():
        want = [step(model, cache, t) for t in decode_tokens()]
    original_files = cache.placement.disk.files()
    cache.placement.close()  # the original's files are gone: the saved file holds every byte
    assert original_files and not any(f.exists() for f in original_files)

    loaded = load_cache(path, model.config)
    assert type(loaded) is type(cache) and loaded.get_seq_length() == PROMPT
    assert loaded.tier_bytes().disk == on_disk
    files = loaded.placement.disk.files()
    assert files and not set(files) & set(original_files)
    with torch.no_grad():
        for i, token in enumerate(decode_tokens()):
            got = step(model, loaded, token)
            assert torch.equal(got, want[i]), f"{name}: step {i} after load differs by {(got - want[i]).abs().max():.3g}"
    loaded.placement.close()
    assert not any(f.exists() for f in files)


def test_saving_twice_and_saving_a_loaded_copy_give_the_same_tokens(tmp_path):
    """A save puts the layer in use back on disk, which changes nothing the next step sees; a loaded copy saves too."""
    model, cache = filled("dense, every layer on disk", tmp_path / "tier")
    cache.save(tmp_path / "first.safetensors")
    cache.save(tmp_path / "second.safetensors")
    again = load_cache(tmp_path / "second.safetensors", model.config)
    again.save(tmp_path / "third.safetensors")
    third = load_cache(tmp_path / "third.safetensors", model.config)
    with torch.no_grad():
        for token in decode_tokens():
            assert torch.equal(step(model, third, token), step(model, cache, token))


def spill_file(cache):
    return cache.placement.disk.files()[0]


@pytest.mark.parametrize("damage", ["cut short", "a flipped byte"])
def test_a_damaged_file_of_the_tier_is_refused_at_save_and_nothing_is_written(damage, tmp_path):
    model, cache = filled("dense, every layer on disk", tmp_path / "tier")
    cache.put_at_rest()
    victim = spill_file(cache)
    data = bytearray(victim.read_bytes())
    if damage == "cut short":
        victim.write_bytes(bytes(data[: len(data) // 2]))
        what = rf"{victim.name} is {len(data) // 2} bytes long, expected {len(data)}"
    else:
        data[len(data) // 3] ^= 0x01
        victim.write_bytes(bytes(data))
        what = rf"{victim.name} holds other bytes than were written"
    with pytest.raises(CorruptFileError, match=what):
        cache.save(tmp_path / "out" / "cache.safetensors")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    with pytest.raises(CorruptFileError, match=what), torch.no_grad():  # the layer's data is lost: every use refused
        step(model, cache, decode_tokens()[0])


def test_a_load_onto_a_full_disk_is_a_disk_tier_error_naming_the_bytes(tmp_path, monkeypatch):
    model, cache = filled("dense, every layer on disk", tmp_path / "tier")
    path = cache.save(tmp_path / "cache.safetensors")
    writes = []

    def full(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            writes.append(file)
            if len(writes) >= 3:
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(disk_module, "open", full, raising=False)
    with pytest.raises(DiskTierError, match=r"could not write \d+ bytes of \w+ to .*No space left.*; \d+ bytes are free"):
        load_cache(path, model.config)
    monkeypatch.undo()
    assert load_cache(path, model.config).tier_bytes().disk == cache.tier_bytes().disk
