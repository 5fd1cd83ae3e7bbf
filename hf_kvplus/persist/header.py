"""What a saved cache's header says about it, and the checks a load makes against it.

The model fingerprint is read from the config (what decides the K/V a model writes: geometry, vocabulary, positions);
the layout is what each layer holds (storage, retention, format). A load compares both field by field and names
every field that differs.
"""

from __future__ import annotations

import importlib.metadata

from ..errors import CacheMismatchError, FileFormatError
from ..fingerprint import fingerprint

FORMAT = "hf_kvplus.cache"
#: Bumped when a file written now could not be read by the code that read the files before. Version 2: a turning key
#: centre's position tables are its rotary basis's (shared by the cache's layers, not saved), no longer the centre's
#: own attributes, so a version-1 file names attributes this code's centre does not have. Version 3: a rotated
#: format is a value and a layer's key centre is its storage's state (`state` beside `fmt`), so a version-2 file's
#: formats name a `key_center` field this code's formats do not have.
FORMAT_VERSION = 3


def package_version() -> str:
    try:
        return importlib.metadata.version("hf-kvplus")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree without its metadata
        return "unknown"


def layout(cache) -> list[dict]:
    """Per layer: its storage, retention and formats (None for Transformers' own layers)."""
    rows = []
    for index, layer in enumerate(cache.layers):
        storage = getattr(layer, "storage", None)
        if storage is None:
            rows.append({"layer": index, "kind": type(layer).__name__})
            continue
        rows.append({
            "layer": index, "kind": layer.spec.kind, "storage": type(storage).__name__,
            "retention": type(layer.retention).__name__, "formats": [str(f) for f in storage.formats()],
        })  # fmt: skip
    return rows


def check_format(header: dict, path) -> None:
    if header.get("format") != FORMAT:
        raise FileFormatError(f"{path} is a {header.get('format')!r} file, not a saved hf_kvplus cache ({FORMAT!r})")
    version = header.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FileFormatError(
            f"{path} is format version {version!r}, written by hf_kvplus {header.get('hf_kvplus_version')}; this "
            f"hf_kvplus {package_version()} reads versions up to {FORMAT_VERSION}: upgrade hf_kvplus to load it"
        )
    if version < FORMAT_VERSION:
        raise FileFormatError(
            f"{path} is format version {version}, written by hf_kvplus {header.get('hf_kvplus_version')}; this "
            f"hf_kvplus {package_version()} reads version {FORMAT_VERSION} only: save the cache again with it"
        )


def check_model(saved: dict, config, path) -> None:
    here = fingerprint(config)
    differ = sorted(k for k in saved.keys() | here.keys() if saved.get(k) != here.get(k))
    if differ:
        what = "; ".join(f"{k}: file {_short(saved.get(k))}, config {_short(here.get(k))}" for k in differ)
        raise CacheMismatchError(f"{path} holds a cache of another model than this config's ({what})")


def check_layout(saved: list[dict], expected: list[dict], path) -> None:
    if len(saved) != len(expected):
        raise CacheMismatchError(f"{path} holds {len(saved)} layers, the expected cache has {len(expected)}")
    for got, want in zip(saved, expected, strict=True):
        differ = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
        if differ:
            what = "; ".join(f"{k}: file {got.get(k)!r}, expected {want.get(k)!r}" for k in differ)
            raise CacheMismatchError(f"{path}: layer {got.get('layer')} has another layout than expected ({what})")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
