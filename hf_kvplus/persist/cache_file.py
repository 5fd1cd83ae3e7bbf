"""`save_cache` and `load_cache`: a cache in one safetensors file whose metadata is a JSON header.

The file holds one uint8 tensor per tensor storage of the cache (`s0`, `s1`, ...), each with its length and XXH3
checksum in the header, and the header's own checksum beside it: a file cut short, grown or altered is refused with
`CorruptFileError` before any of it is used. Writing goes to a temporary file in the same folder, which is flushed
to disk and then renamed over `path`, so a reader never sees half a file and a failed save leaves the old one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from xxhash import xxh3_64_hexdigest

from ..errors import ConfigError, CorruptFileError, DeviceError, FileFormatError
from . import header as h
from .graph import _dtype, decode, encode

_HEADER_KEY, _CHECKSUM_KEY = "hf_kvplus", "hf_kvplus.xxh3"


def save_cache(cache, path: str | os.PathLike, config=None, spec: str | None = None) -> Path:
    """Writes `cache` (any hf_kvplus cache, used or not) to `path`; returns the path. The model it belongs to is
    read from `config`, by default the one the cache was built from (`KVCache.model_fingerprint`); `spec`, the cache
    spec it was built from if any, is recorded in the header.

    An offloaded cache's disk tier is saved from its files, each read back checked first (`CorruptFileError` if one
    was cut short or altered: nothing is written). What cannot be saved is refused before anything is written
    (`UnsupportedOperationError`: a pool shared with other caches, optimum-quanto's tensors)."""
    path = Path(path)
    model = h.fingerprint(config) if config is not None else getattr(cache, "model_fingerprint", None)
    if model is None:
        raise ConfigError(f"{type(cache).__name__} does not know its model's config: pass config= to save it")
    settle = getattr(cache, "put_at_rest", None)
    if callable(settle):
        settle()  # (the layer in use back at rest: the file then holds each layer's bytes once)
    encoded = encode(cache)
    blobs, records = {}, {}
    for i, storage in enumerate(encoded.storages):
        data = encoded.replaced.get(i)
        if data is None:
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).cpu().contiguous()
        blobs[f"s{i}"] = data
        records[f"s{i}"] = {"nbytes": data.numel(), "xxh3": xxh3_64_hexdigest(data.numpy())}
    dtypes = sorted({str(getattr(layer, "dtype", "")).removeprefix("torch.") for layer in cache.layers} - {""})
    header = {
        "format": h.FORMAT, "format_version": h.FORMAT_VERSION, "hf_kvplus_version": h.package_version(),
        "torch_version": torch.__version__, "model": model, "cache": type(cache).__name__,
        "spec": spec, "dtype": dtypes, "layers": h.layout(cache), "storages": records,
        "tensors": encoded.tensors, "graph": encoded.root,
    }  # fmt: skip
    text = json.dumps(header, separators=(",", ":"))
    metadata = {_HEADER_KEY: text, _CHECKSUM_KEY: xxh3_64_hexdigest(text.encode())}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(blobs, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path: str | os.PathLike) -> dict:
    """The header of a saved cache, checked (format, version, checksum); no tensor is read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size <= 0 or size > path.stat().st_size - 8:
                raise CorruptFileError(
                    f"{path} is cut short or not a safetensors file: its header says {size} bytes, "
                    f"{max(0, path.stat().st_size - 8)} follow"
                )
            meta = json.loads(f.read(size)).get("__metadata__") or {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: its safetensors header is not readable JSON ({e})") from None
    if _HEADER_KEY not in meta:
        raise FileFormatError(f"{path} is a safetensors file without an hf_kvplus header: not a saved cache")
    text = meta[_HEADER_KEY]
    if xxh3_64_hexdigest(text.encode()) != meta.get(_CHECKSUM_KEY):
        raise CorruptFileError(
            f"{path}: the header's XXH3 is {xxh3_64_hexdigest(text.encode())}, the file says {meta.get(_CHECKSUM_KEY)}"
        )
    header = json.loads(text)
    h.check_format(header, path)
    return header


def load_cache(path: str | os.PathLike, config, *, device: str | torch.device | None = None, like=None):
    """The cache saved at `path`, for the model of `config`, ready to continue where it stopped.

    Refuses another model (`CacheMismatchError` naming the config fields that differ), another format or a newer
    format version (`FileFormatError`), a file cut short or altered (`CorruptFileError`), and, given `like` (a
    cache built as the caller expects, e.g. from the same spec), another layout. `device` moves the tensors that
    were on an accelerator there (host copies stay in host memory); by default they return where they were."""
    path = Path(path)
    header = read_header(path)
    h.check_model(header["model"], config, path)
    if like is not None:
        h.check_layout(header["layers"], h.layout(like), path)
    try:
        blobs = load_file(path)
    except (SafetensorError, OSError) as e:
        raise CorruptFileError(f"{path} is not a whole safetensors file: {e}") from None
    for name, record in header["storages"].items():
        blob = blobs.get(name)
        if blob is None or blob.numel() != record["nbytes"]:
            found = "missing" if blob is None else f"{blob.numel()} bytes"
            raise CorruptFileError(f"{path}: storage {name} should hold {record['nbytes']} bytes, found {found}")
        digest = xxh3_64_hexdigest(blob.numpy())
        if digest != record["xxh3"]:
            raise CorruptFileError(f"{path}: storage {name}'s XXH3 is {digest}, the header says {record['xxh3']}")
    target = None if device is None else torch.device(device)
    tensors = _tensors(header["tensors"], blobs, target, path)
    graph = header["graph"]
    if target is not None:
        graph = _moved(graph, target)
    cache = decode(graph, tensors)
    h.check_layout(header["layers"], h.layout(cache), path)
    return cache


def _place(recorded: str, target: torch.device | None) -> torch.device:
    place = torch.device(recorded)
    if place.type != "cpu" and target is not None:
        place = target
    if place.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"the cache was saved with tensors on {recorded}; this machine has no CUDA device: pass device=")
    return place


def _tensors(records: list[dict], blobs: dict, target, path) -> list[torch.Tensor]:
    storages: dict[tuple[int, torch.device], torch.UntypedStorage] = {}
    made = []
    for record in records:
        place = _place(record["device"], target)
        key = (record["storage"], place)
        if key not in storages:
            storages[key] = _aligned(blobs[f"s{record['storage']}"]).to(place).untyped_storage()
        dtype = _dtype(record["dtype"])
        storage = storages[key]
        end = record["offset"] + sum((n - 1) * s for n, s in zip(record["shape"], record["stride"], strict=True)) + 1
        if min(record["shape"], default=1) > 0 and end * dtype.itemsize > storage.nbytes():
            raise CorruptFileError(f"{path}: a {record['dtype']} tensor of shape {record['shape']} reaches past its storage")
        tensor = torch.empty(0, dtype=dtype, device=place)
        made.append(tensor.set_(storage, record["offset"], record["shape"], record["stride"]))
    return made


def _aligned(blob: torch.Tensor) -> torch.Tensor:
    """A copy of `blob` in a fresh allocation, aligned as the kernels' vector loads expect (a file's offsets are not:
    a KVzip cache's logits differed by 4e-6 read from them). Copied by numpy, one memcpy: torch's `copy_` wakes its
    thread pool, slow on a busy machine."""
    fresh = torch.empty(blob.shape, dtype=torch.uint8)
    fresh.numpy()[:] = blob.numpy()
    return fresh


def _moved(node, target: torch.device):
    """The graph with every accelerator device named in it replaced by `target`."""
    if isinstance(node, dict):
        if "$device" in node and torch.device(node["$device"]).type != "cpu":
            return {"$device": str(target)}
        return {k: _moved(v, target) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved(v, target) for v in node]
    return node
