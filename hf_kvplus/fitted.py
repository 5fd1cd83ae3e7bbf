"""Artifacts fitted to one model (a KVzap surrogate, a low-bit calibration, a key scale), found from the model's config.

`KVzapCache(model.config, budget=0.2)`, the spec `kvzap:20%` and `quantized:k4v2:calibration=auto` need no path: the
model's key (`model_key`: its type, layers, KV heads, head size, hidden size and vocabulary, read off the config) names
a folder, looked for first in the user cache folder (`user_dir`, where `kvplus train-surrogate` and `kvplus calibrate`
write by default) and then in the package data that ships with hf_kvplus (`PACKAGED`: SmolLM2-135M and Gemma 3 270M).
Nothing else is tried: a model with neither gets `ArtifactNotFoundError`, saying the command that makes one, what it
cost when measured and where it writes. An artifact always checks the config it is used with (`Surrogate.check`,
`Calibration.check`) and refuses another model with `CacheMismatchError`, naming both.

Layout, the same in both places::

    <root>/<model key>/kvzap/surrogate.safetensors
    <root>/<model key>/calibration/<bits>/calibration.json
    <root>/<model key>/key_scale/key_scale.safetensors

A key scale (`key_scale.KeyScale`) is the one artifact a cache takes by default where it is found (a rotated format's
keys, `QuantizedCache(key_scale="auto")`): a model without one keeps its keys unscaled, with no error.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedConfig

from .calibration import Calibration
from .errors import ArtifactNotFoundError, ConfigError
from .formats import any_rotated, parse_bits
from .key_scale import KeyScale
from .model_spec import ModelSpec
from .surrogate import Surrogate
from .user_cache import cache_root

#: The artifacts shipped inside the package.
PACKAGED = Path(__file__).parent / "data" / "fitted"
#: The models whose artifacts ship, by model key.
PACKAGED_MODELS = {"llama-l30-kv3-d64-h576-v49152": "SmolLM2-135M", "gemma3_text-l18-kv1-d256-h640-v262144": "Gemma 3 270M"}
#: What making one cost, measured for Gemma 3 270M on a 2-core CPU shared with other jobs, torch on 1 thread: the CPU
#: time, which the load does not change, and the wall time it took under that load.
COSTS = {
    "kvzap": "Gemma 3 270M, the command's defaults: KVzip scores of 12,288 tokens (6 chunks of 2,048 from three Austen "
    "novels, three with numbers added) and 2,048 held out, 198 s of CPU time (30 min wall where it got a tenth of a "
    "core), 2.5 GB resident",
    "key_scale": "Gemma 3 270M, 2,048 tokens of Persuasion: one cache-free forward, under a minute",
    "calibration": "Gemma 3 270M, k4v2 with one candidate per layer (--up k4v3) over 512 tokens (--tokens 512): 21 "
    "perplexity passes, 190 s of CPU time (17 min wall where it got a fifth of a core), 3.7 GB resident",
}


def model_key(config: PreTrainedConfig) -> str:
    """The folder name of a model's artifacts: e.g. "llama-l30-kv3-d64-h576-v49152" (SmolLM2-135M). Read off the
    config, so it does not depend on where the model was loaded from; a fine-tune of the same base shares it (its
    artifacts are then the base's: make its own to replace them, in the user folder, which is looked at first)."""
    spec = ModelSpec.from_config(config)
    text = getattr(config, "get_text_config", lambda: config)()
    heads = sorted({layer.num_kv_heads for layer in spec.layers if layer.holds_kv})
    dims = sorted({layer.head_dim for layer in spec.layers if layer.holds_kv})
    parts = [getattr(config, "model_type", "") or "model", f"l{spec.num_layers}",
             "kv" + "_".join(map(str, heads)), "d" + "_".join(map(str, dims)),
             f"h{getattr(text, 'hidden_size', 0)}", f"v{getattr(text, 'vocab_size', 0)}"]  # fmt: skip
    return "-".join(parts)


def user_dir(config: PreTrainedConfig, kind: str) -> Path:
    """Where the commands write an artifact of `kind` ("kvzap", or "calibration/<bits>") for this model by default,
    and where the loader looks first: `<user cache>/fitted/<model key>/<kind>` (not created)."""
    return cache_root(create=False) / "fitted" / model_key(config) / kind


def find(config: PreTrainedConfig, kind: str, filename: str) -> Path | None:
    """The artifact file for this model: the user folder's, else the package's, else None."""
    for root in (cache_root(create=False) / "fitted", PACKAGED):
        path = root / model_key(config) / kind / filename
        if path.is_file():
            return path
    return None


def surrogate_for(config: PreTrainedConfig) -> Surrogate:
    """The KVzap surrogate for this model (`find`), checked against the config."""
    path = find(config, "kvzap", "surrogate.safetensors")
    if path is None:
        raise ArtifactNotFoundError(_missing(config, "KVzap surrogate", "kvzap",
                                             "kvplus train-surrogate --model {model} --threads 1"))  # fmt: skip
    surrogate = Surrogate.load(path)
    surrogate.check(config)
    return surrogate


def calibration_for(config: PreTrainedConfig, bits: int | str) -> Calibration:
    """The calibration of format `bits` for this model (`find`), checked against the config and the format."""
    name = str(parse_bits(bits))
    path = find(config, f"calibration/{name}", "calibration.json")
    if path is None:
        raise ArtifactNotFoundError(_missing(
            config, f"{name} calibration", f"calibration/{name}",
            f"kvplus calibrate --model {{model}} --bits {name} --up FORMATS --max-bits BITS --text austen:persuasion "
            "--tokens 512 --threads 1", "FORMATS: each layer's candidates, e.g. k4v3 for k4v2; BITS: the bits per "
            "coordinate allowed, e.g. 3.5 for k4v2",
        ))  # fmt: skip
    calibration = Calibration.load(path)
    calibration.check(config, bits)
    return calibration


def key_scale_for(config: PreTrainedConfig, key_scale="auto") -> KeyScale | None:
    """The key scale a rotated cache of this model takes: `key_scale` "auto" (this model's, `find`, or None where it
    has none), None or "off" (none), a `KeyScale` or the path of its file; checked against the config."""
    if key_scale is None or (isinstance(key_scale, str) and key_scale in ("off", "auto")):
        if key_scale != "auto":
            return None
        path = find(config, "key_scale", "key_scale.safetensors")
        if path is None:
            return None
        key_scale = path
    if not isinstance(key_scale, KeyScale):
        if not isinstance(key_scale, (str, Path)):
            raise ConfigError(f"key_scale must be 'auto', 'off', None, a KeyScale or the path of its file, got "
                              f"{key_scale!r}")  # fmt: skip
        key_scale = KeyScale.load(key_scale)
    key_scale.check(config)
    return key_scale


def shipped() -> list[str]:
    """The artifacts in the package data, as "<model key>/<kind>" (e.g. "llama-l30-kv3-d64-h576-v49152/kvzap")."""
    files = [*PACKAGED.glob("*/kvzap/surrogate.safetensors"), *PACKAGED.glob("*/calibration/*/calibration.json"),
             *PACKAGED.glob("*/key_scale/key_scale.safetensors")]
    return sorted(str(path.parent.relative_to(PACKAGED)) for path in files)


def _missing(config, what: str, kind: str, command: str, note: str = "") -> str:
    """`ArtifactNotFoundError`'s message: where it was looked for, the command that makes one, its cost."""
    model = getattr(config, "_name_or_path", "") or "MODEL"
    known = [PACKAGED_MODELS.get(item.split("/")[0], item.split("/")[0]) for item in shipped() if item.endswith(kind)]
    return (
        f"no {what} for {model} (model key {model_key(config)}) in {user_dir(config, kind)} or in hf_kvplus's "
        f"package data (which has one for {', '.join(known) or 'no model'}). Make one: "
        f"`{command.format(model=model)}` writes it to {user_dir(config, kind)}, where this lookup finds it "
        f"(--model: a built-in name, a model folder or a hub id{'; ' + note if note else ''}). Measured cost: "
        f"{COSTS[kind.split('/')[0]]}."
    )


def calibrated_layers(config: PreTrainedConfig, bits: int | str, calibration, layer_bits=None, key_scale="auto",
                      layer_rotations=None):
    """`(layer_bits, layer_rotations)` for a quantized cache of format `bits`: from `calibration` ("auto": this model's,
    `calibration_for`; a `Calibration`; or the path of its file), checked against the config, the format and the key
    scale the cache takes (`key_scale`, as `key_scale_for` reads it, where its formats are rotated), or as given when
    `calibration` is None."""
    if calibration is None:
        return layer_bits, layer_rotations
    for name, given in (("layer_bits", layer_bits), ("layer_rotations", layer_rotations)):
        if given:
            raise ConfigError(f"give {name} ({dict(given)}) or calibration ({calibration!r}), not both")
    if isinstance(calibration, str) and calibration == "auto":
        calibration = calibration_for(config, bits)
    else:
        if not isinstance(calibration, Calibration):
            calibration = Calibration.load(calibration)
        calibration.check(config, bits)
    rotated = any_rotated(calibration.bits, *calibration.layer_bits.values())
    calibration.check_key_scale(key_scale_for(config, key_scale) if rotated else None)
    return calibration.layer_bits, calibration.layer_rotations
