"""A calibration: the layers of one model that a quantized cache holds at other bits, and the layers it rotates with
a seed of their own, chosen by measuring (`kvplus calibrate`), saved as JSON and reloaded into any quantized cache
(`layer_bits`, `layer_rotations`).

Layers differ in how much a format costs them: on SmolLM2-135M one layer at more bits removes from nothing to a
fifth of k4v2's perplexity cost. A calibration spends a bits budget where it pays, for one model and format. A full
layer's rotation matters too where a text's frequent tokens take much of the attention (Gemma 3: one rotation gives
every occurrence of a token about the same coding error, which attention adds up): of several rotations, the one
that measured least divergence costs no bits.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import PreTrainedConfig

from .errors import CacheMismatchError, ConfigError
from .formats import is_rotated, parse_bits
from .model_spec import ModelSpec

#: Version of the JSON layout `Calibration.save` writes.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """Per-layer formats for one model: `layer_bits` ({layer index: bits}) on top of the cache's `bits`.

    `model` names the model it was measured on and `num_layers` is its layer count (checked against the config a cache
    is built for); `bits_per_coordinate` is what the calibrated cache measured, against `max_bits`, its budget;
    `measured` records how (text, tokens, chunk size, seed, perplexity changes, each layer's gain).
    `layer_rotations` ({layer index: seed}) rotates those layers with a seed of their own, in place of the cache's
    `rotation_seed + index` (the seed is the rotation's, whatever seed the cache is built with).
    """

    model: str
    model_type: str
    num_layers: int
    bits: str
    layer_bits: dict[int, int | str | None]
    max_bits: float
    bits_per_coordinate: float
    measured: dict = field(default_factory=dict)
    layer_rotations: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        parse_bits(self.bits)
        for index, bits in self.layer_bits.items():
            if not 0 <= index < self.num_layers:
                raise ConfigError(f"calibration names layer {index}, but {self.model} has {self.num_layers} layers")
            if bits is not None:
                parse_bits(bits)
        for index, seed in self.layer_rotations.items():
            if not 0 <= index < self.num_layers:
                raise ConfigError(f"calibration rotates layer {index}, but {self.model} has {self.num_layers} layers")
            held = self.layer_bits.get(index, self.bits)
            if isinstance(seed, bool) or not isinstance(seed, int) or held is None or not is_rotated(held):
                raise ConfigError(f"calibration rotates layer {index} with seed {seed!r}: a rotation seed is an int "
                                  f"and the layer's format a rotated one, got {held!r}")  # fmt: skip

    def check(self, config: PreTrainedConfig, bits: int | str | None = None) -> None:
        """Refuses a model or a cache format other than the one it was measured for."""
        spec = ModelSpec.from_config(config)
        model_type = getattr(config, "model_type", "")
        if spec.num_layers != self.num_layers or model_type != self.model_type:
            name = getattr(config, "_name_or_path", "") or "this model"
            raise CacheMismatchError(
                f"the calibration is for {self.model} ({self.model_type}, {self.num_layers} layers); {name} is "
                f"{model_type or 'unknown'} with {spec.num_layers} layers: calibrate it with `kvplus calibrate --model "
                "MODEL`"
            )
        if bits is not None:
            self.check_bits(bits)

    def check_key_scale(self, key_scale) -> None:
        """Refuses a cache whose keys are scaled (`key_scale`: a `KeyScale` or None) otherwise than when its layers were
        measured: which layers pay for more bits depends on the error each layer's keys carry, which the scale changes
        (on Gemma 3 270M the full layers' logit error falls 6-26 times with it)."""
        theirs = self.measured.get("key_scale_digest")
        ours = None if key_scale is None else key_scale.digest()
        if theirs != ours:
            measured = f"key scale {self.measured.get('key_scale')} ({theirs})" if theirs else "no key scale"
            used = f"key scale {key_scale.model} ({ours})" if key_scale is not None else "no key scale"
            raise ConfigError(
                f"the {self.bits} calibration of {self.model} was measured with {measured}; this cache codes keys "
                f"with {used}: calibrate with the scale the cache uses (`kvplus calibrate --model MODEL --bits "
                f"{self.bits}`), or build the cache with the scale it was measured with (key_scale=...)"
            )

    def check_bits(self, bits: int | str) -> None:
        """Refuses a cache format other than the one it chose layers for."""
        if parse_bits(bits) != parse_bits(self.bits):
            raise ConfigError(f"the calibration chose layers for bits={self.bits!r}; the cache asks for bits={bits!r}")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        record = asdict(self) | {"version": FORMAT_VERSION}
        record["layer_bits"] = {str(index): bits for index, bits in sorted(self.layer_bits.items())}
        record["layer_rotations"] = {str(index): seed for index, seed in sorted(self.layer_rotations.items())}
        path.write_text(json.dumps(record, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no calibration file at {path}: `kvplus calibrate --model MODEL --bits BITS --out "
                              f"{path.parent}` writes {path.parent / 'calibration.json'} (--out is a folder); without "
                              "--out it writes where calibration='auto' finds it") from None  # fmt: skip
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is not a calibration (not JSON: {error})") from None
        version = record.pop("version", None)
        if version != FORMAT_VERSION:
            raise ConfigError(f"{path}: calibration layout version {version!r}, this hf_kvplus reads {FORMAT_VERSION}")
        record["layer_bits"] = {int(index): bits for index, bits in record["layer_bits"].items()}
        record["layer_rotations"] = {int(index): seed for index, seed in record.get("layer_rotations", {}).items()}
        return cls(**record)
