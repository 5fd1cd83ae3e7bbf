"""What a saved cache's header says about it, and the checks a load makes against it.

The model fingerprint is read from the config (what decides the K/V a model writes: geometry, vocabulary, positions);
the layout is what each layer holds (storage, retention, format). A load compares both field by field and names
every field that differs.
"""

from __future__ import annotations

import importlib.metadata

from ..errors import CacheMismatchError, FileFormatError
from ..model_spec import ModelSpec

FORMAT = "hf_kvplus.cache"
#: Bumped when a file written now could not be read by the code that reads version-1 files.
FORMAT_VERSION = 1
#: Config fields that change the K/V a model writes at a position, beside the attention geometry.
_CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings", "rope_theta",
    "rope_parameters", "rope_scaling", "partial_rotary_factor", "query_pre_attn_scalar", "sliding_window",
)  # fmt: skip


def package_version() -> str:
    try:
        return importlib.metadata.version("hf-kvplus")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree without its metadata
        return "unknown"


def fingerprint(config) -> dict:
    """The model a cache belongs to, as JSON values read from its config."""
    spec = ModelSpec.from_config(config)
    text = config.get_text_config(decoder=True)
    found = {"model_type": spec.model_type, "num_attention_heads": spec.num_attention_heads}
    found["layers"] = [[s.kind, s.window, s.num_kv_heads, s.head_dim] for s in spec.layers]
    for name in _CONFIG_FIELDS:
        value = getattr(text, name, None)
        if value is not None:
            found[name] = _jsonable(value)
    return found


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


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
