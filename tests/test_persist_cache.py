"""Caches saved with `cache.save(path)` and read back with `load_cache(path, config)` continue with the same logits.

One spec per family (dense, paged, quantized with a rotated format, evicting with quantized slots, KVzip- and
KVzap-compressed, offloaded in host memory and beyond a disk tier), filled by a 72-token prompt on the tiny Llama:
the loaded copy and the original then decode the same tokens, and their logits must be equal bit for bit, eagerly,
through a compiled decode step for the families that compile, and in a new process (a quantized cache, and an
offloaded one whose layers rest in its disk tier's files: more of those in `test_persist_offloaded.py`). What a load refuses: another
model, another format, a newer format version, another layout, a file cut short or with one byte changed, and a
graph that names anything outside hf_kvplus.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from xxhash import xxh3_64_hexdigest

from conformance.models import get_model
from hf_kvplus import PagedCache, PagedPool, QuantizedCache, cache_kwargs, load_cache
from hf_kvplus.errors import CacheMismatchError, CorruptFileError, FileFormatError, UnsupportedOperationError
from hf_kvplus.kvzip_cache import KVzipCache, RepeatPrompt
from hf_kvplus.persist import FORMAT_VERSION
from hf_kvplus.specs import parse_cache_spec

PROMPT, STEPS = 72, 3
KVZAP_WEIGHTS = Path(tempfile.gettempdir()) / f"hf_kvplus_test_persist_kvzap_{os.getpid()}.safetensors"

SPECS = [
    "dense", "paged:block=8", "paged-quantized:int4:window=16:block=16", "quantized:int4:window=16:first=4",
    "quantized:k4v2:window=16:boundary=1", "sink:4:28:bits=int4", "h2o:32:bits=int8", "snapkv:32:observation=8",
    "kvzip:32", f"kvzap:32:weights={KVZAP_WEIGHTS}:bits=int4:compress=always", "offloaded",
    "offloaded-quantized:int4:window=16", "offloaded:disk=tmp:host=1G",
]  # fmt: skip
COMPILED = [
    "dense:max_tokens=96:compile=on", "paged:block=8:max_tokens=96:compile=on",
    "quantized:k4v2:window=16:max_tokens=96:compile=on", "h2o:32:compile=on", "sink:4:28:bits=int4:compile=on",
]  # fmt: skip (offloaded caches do not compile: `check_compileable` refuses a placement that moves bytes)
#: KVzip's repeat prompt around the context (`KVzipCache.compress`), in the tiny Llama's token ids.
REPEAT = RepeatPrompt(first=(1, 2, 3), later=(4, 5), suffix=(6,))


@pytest.fixture(scope="module", autouse=True)
def kvzap_weights():
    from test_kvzap import random_surrogate

    random_surrogate(get_model("llama").config).save(KVZAP_WEIGHTS)
    yield
    KVZAP_WEIGHTS.unlink(missing_ok=True)


def prompt_ids(n=PROMPT, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def decode_tokens(seed=1):
    return torch.randint(3, 128, (STEPS, 1, 1), generator=torch.Generator().manual_seed(seed))


def step(forward, cache, tokens):
    return forward(tokens, **cache_kwargs(cache)).logits[:, -1]


def filled(spec: str):
    """The cache of `spec` after the prompt; a KVzip cache then compressed (its second pass over the context)."""
    model = get_model("llama")
    cache = parse_cache_spec(spec).build(model.config, max_length=96)
    with torch.no_grad():
        step(model, cache, prompt_ids())
        if isinstance(cache, KVzipCache):
            cache.compress(model, prompt_ids(), prompt=REPEAT)
    return model, cache


def assert_same_after_load(spec, forward, cache, loaded):
    """The original and the loaded copy, each stepped through `forward`, give equal logits."""
    with torch.no_grad():
        for i, token in enumerate(decode_tokens()):
            want, got = step(forward, cache, token), step(forward, loaded, token)
            assert torch.equal(got, want), f"{spec}: step {i} after load differs by {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.replace(str(KVZAP_WEIGHTS), "WEIGHTS"))
def test_a_loaded_cache_continues_with_the_same_logits(spec, tmp_path):
    model, cache = filled(spec)
    cache.save(tmp_path / "cache.safetensors")
    loaded = load_cache(tmp_path / "cache.safetensors", model.config)
    assert type(loaded) is type(cache) and loaded is not cache
    assert loaded.get_seq_length() == cache.get_seq_length() == PROMPT
    if spec.startswith(("kvzip", "kvzap")):  # compressed: the slots, positions and scores of what it kept travel
        assert loaded.memory_report().tokens_held == cache.memory_report().tokens_held < PROMPT
    assert_same_after_load(spec, model, cache, loaded)


def recording_backend(gm, example_inputs, **kwargs):
    recording_backend.graphs += 1
    return gm.forward  # dynamo's capture run with eager ops: equal to eager bit for bit


@pytest.mark.parametrize("spec", COMPILED)
def test_a_loaded_compileable_cache_continues_through_a_compiled_step(spec, tmp_path):
    torch._dynamo.reset()
    recording_backend.graphs = 0
    model, cache = filled(spec)
    assert cache.is_compileable
    cache.save(tmp_path / "cache.safetensors")
    loaded = load_cache(tmp_path / "cache.safetensors", model.config)
    assert loaded.is_compileable
    compiled = torch.compile(model.forward, backend=recording_backend, fullgraph=True)
    with torch.no_grad():
        for i, token in enumerate(decode_tokens()):
            want = step(compiled, cache, token)
            graphs = recording_backend.graphs
            got = step(compiled, loaded, token)
            assert torch.equal(got, want), f"{spec}: step {i} after load differs by {(got - want).abs().max():.3g}"
            # the copy takes the original's graph: dynamo's guards see the same state (one tensor held twice still
            # one object, the derived tables made again at load), not a graph of its own
            assert recording_backend.graphs == graphs, f"{spec}: step {i}: the loaded copy compiled a graph of its own"
    assert recording_backend.graphs >= 1


CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from conformance.models import get_model
from hf_kvplus import cache_kwargs, load_cache
model = get_model("llama")
cache = load_cache({path!r}, model.config)
tokens = torch.randint(3, 128, ({steps}, 1, 1), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = torch.stack([model(t, **cache_kwargs(cache)).logits[:, -1] for t in tokens])
torch.save(logits, {out!r})
"""


@pytest.mark.parametrize("spec", ["quantized:int4:window=16", "offloaded:disk=tmp:host=0"])
def test_a_cache_loaded_in_a_new_process_continues_with_the_same_logits(spec, tmp_path):
    model, cache = filled(spec)
    path, out = tmp_path / "cache.safetensors", tmp_path / "logits.pt"
    cache.save(path)
    code = CHILD.format(tests=str(Path(__file__).parent), path=str(path), steps=STEPS, out=str(out))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if torch.device(torch.get_default_device()).type == "cpu" else None
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    with torch.no_grad():
        want = torch.stack([step(model, cache, t) for t in decode_tokens()]).cpu()
    assert torch.equal(torch.load(out), want)


def rewritten(path: Path, change) -> None:
    """Rewrites the header of the saved cache at `path` through `change(header)`, with a valid header checksum."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        meta = f.metadata()
    header = json.loads(meta["hf_kvplus"])
    change(header)
    text = json.dumps(header)
    save_file(load_file(path), path, metadata={"hf_kvplus": text, "hf_kvplus.xxh3": xxh3_64_hexdigest(text.encode())})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, cache = filled("quantized:int4:window=16")
    path = tmp_path_factory.mktemp("saved") / "cache.safetensors"
    cache.save(path)
    return model, path


def copy_of(path: Path, tmp_path: Path) -> Path:
    target = tmp_path / path.name
    target.write_bytes(path.read_bytes())
    return target


def test_another_model_is_refused_naming_what_differs(saved):
    model, path = saved
    other = type(model.config)(**{**model.config.to_dict(), "vocab_size": 256})
    with pytest.raises(CacheMismatchError, match=r"vocab_size: file 128, config 256"):
        load_cache(path, other)
    with pytest.raises(CacheMismatchError, match=r"model_type: file 'llama', config 'mistral'"):
        load_cache(path, get_model("mistral").config)


def test_another_layout_is_refused_naming_the_layer(saved):
    model, path = saved
    with pytest.raises(CacheMismatchError, match=r"layer 0 .*formats: file \['int4.*'\], expected \['k4v2"):
        load_cache(path, model.config, like=QuantizedCache(model.config, bits="k4v2"))
    assert load_cache(path, model.config, like=QuantizedCache(model.config, bits=4, window=16)).get_seq_length() == PROMPT


def test_another_format_and_a_newer_version_are_refused(saved, tmp_path):
    model, path = saved
    plain = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(3)}, plain)
    with pytest.raises(FileFormatError, match="without an hf_kvplus header"):
        load_cache(plain, model.config)
    other = copy_of(path, tmp_path)
    rewritten(other, lambda h: h.update(format="someone.else"))
    with pytest.raises(FileFormatError, match=r"'someone.else' file, not a saved hf_kvplus cache"):
        load_cache(other, model.config)
    newer = copy_of(path, tmp_path)
    rewritten(newer, lambda h: h.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(FileFormatError, match=rf"format version {FORMAT_VERSION + 1}, .* reads versions up to {FORMAT_VERSION}"):
        load_cache(newer, model.config)
    older = copy_of(path, tmp_path)
    rewritten(older, lambda h: h.update(format_version=FORMAT_VERSION - 1))
    with pytest.raises(FileFormatError, match=rf"format version {FORMAT_VERSION - 1}, .* reads version {FORMAT_VERSION} only"):
        load_cache(older, model.config)


@pytest.mark.parametrize("entry", [
    {"$object": "os:system", "attrs": {}, "id": 0}, {"$call": "os:system", "args": {"$list": ["true"]}, "id": 0},
    {"$partial": {"$name": "builtins:eval"}, "args": {"$list": []}, "keywords": {"$dict": [], "kind": "dict", "id": 1}},
    {"$name": "subprocess:run"},
])  # fmt: skip
def test_a_graph_naming_code_outside_hf_kvplus_is_refused(saved, tmp_path, entry):
    model, path = saved
    evil = copy_of(path, tmp_path)
    rewritten(evil, lambda h: h.update(graph=entry))
    with pytest.raises(FileFormatError, match=r"which is not an hf_kvplus class or function"):
        load_cache(evil, model.config)


def test_a_truncated_file_is_refused(saved, tmp_path):
    model, path = saved
    data = path.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 100, 4):
        cut = tmp_path / f"cut{keep}.safetensors"
        cut.write_bytes(data[:keep])
        with pytest.raises(CorruptFileError):
            load_cache(cut, model.config)


def test_a_flipped_byte_is_refused_in_the_tensors_and_in_the_header(saved, tmp_path):
    model, path = saved
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    for where, what in ((len(data) - 10, r"storage s\d+'s XXH3"), (header_end - 200, None)):
        flipped = bytearray(data)
        flipped[where] ^= 0x01
        bad = tmp_path / "flipped.safetensors"
        bad.write_bytes(bytes(flipped))
        with pytest.raises((CorruptFileError, FileFormatError), match=what):
            load_cache(bad, model.config)


def test_a_failed_save_leaves_the_old_file_and_no_temporary(saved, tmp_path, monkeypatch):
    model, path = saved
    target = copy_of(path, tmp_path)
    before = target.read_bytes()

    def dies(tensors, tmp, metadata=None):
        Path(tmp).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hf_kvplus.persist.cache_file.save_file", dies)
    _, cache = filled("dense")
    with pytest.raises(OSError, match="No space left"):
        cache.save(target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_pool_shared_with_other_caches_is_refused_before_writing(tmp_path):
    model = get_model("llama")
    shared = PagedCache(model.config, pool=PagedPool(model.config, block_size=8), namespace="tenant")
    with torch.no_grad():
        step(model, shared, prompt_ids())
    with pytest.raises(UnsupportedOperationError, match="shares a PagedPool"):
        shared.save(tmp_path / "cache.safetensors")
    assert not list(tmp_path.iterdir())
