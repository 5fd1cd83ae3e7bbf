"""Model configs to plan for: a few well-known ones shipped as data, local files, or hub ids.

The shipped files (``hf_kvplus/data/configs/*.json``) are the public ``config.json`` contents of the
models below; for Gemma 3 the text decoder's config (``gemma3_text``; the published 4B/12B/27B files
nest it as ``text_config`` of a multimodal config) with `layer_types` written out: five sliding layers
(window 1024; 512 for 270M) to one full layer. They load through `transformers.AutoConfig` exactly as
a downloaded config does, so layer types, windows and rope settings behave like the real thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from transformers import AutoConfig, PreTrainedConfig

from ..errors import ConfigError


@dataclass(frozen=True)
class ShippedConfig:
    """A config shipped with the package: its short name, file, and where it was published."""

    name: str
    file: str
    hub_id: str
    note: str = ""


SHIPPED_CONFIGS: dict[str, ShippedConfig] = {
    c.name: c
    for c in (
        ShippedConfig("llama-3.1-8b", "llama-3.1-8b.json", "meta-llama/Llama-3.1-8B"),
        ShippedConfig("llama-3.1-70b", "llama-3.1-70b.json", "meta-llama/Llama-3.1-70B"),
        ShippedConfig(
            "mistral-7b",
            "mistral-7b-v0.3.json",
            "mistralai/Mistral-7B-v0.3",
            "v0.3: no sliding window (v0.1 had sliding_window 4096), 32768-token vocabulary",
        ),
        ShippedConfig(
            "qwen2.5-7b", "qwen2.5-7b.json", "Qwen/Qwen2.5-7B", "q/k/v biases; use_sliding_window false"
        ),
        ShippedConfig("gemma-3-4b", "gemma-3-4b.json", "google/gemma-3-4b-pt", "text decoder only"),
        ShippedConfig("gemma-3-12b", "gemma-3-12b.json", "google/gemma-3-12b-pt", "text decoder only"),
        ShippedConfig("gemma-3-27b", "gemma-3-27b.json", "google/gemma-3-27b-pt", "text decoder only"),
        ShippedConfig("gemma-3-270m", "gemma-3-270m.json", "google/gemma-3-270m"),
        ShippedConfig("smollm2-135m", "smollm2-135m.json", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    )
}
#: Other spellings of the shipped names.
ALIASES = {
    "mistral-7b-v0.3": "mistral-7b",
    "smollm2-135m-instruct": "smollm2-135m",
    **{f"gemma3-{size}": f"gemma-3-{size}" for size in ("270m", "4b", "12b", "27b")},
}


def shipped_config_path(name: str) -> Path:
    """Path of the shipped config file called `name` (a short name or an alias)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SHIPPED_CONFIGS:
        raise ConfigError(f"no shipped config named {name!r}; shipped: {', '.join(SHIPPED_CONFIGS)}")
    return Path(str(resources.files("hf_kvplus").joinpath("data", "configs", SHIPPED_CONFIGS[key].file)))


def config_name(name_or_path: str | PreTrainedConfig) -> str:
    """A display name: the short name of a shipped config, else the path or hub id, else the model type."""
    if isinstance(name_or_path, PreTrainedConfig):
        source = getattr(name_or_path, "name_or_path", "") or ""
        for shipped in SHIPPED_CONFIGS.values():
            if source and Path(source) == shipped_config_path(shipped.name):
                return shipped.name
        return source or name_or_path.model_type
    key = ALIASES.get(str(name_or_path).lower(), str(name_or_path).lower())
    return key if key in SHIPPED_CONFIGS else str(name_or_path)


def load_config(name_or_path: str | Path | PreTrainedConfig) -> PreTrainedConfig:
    """A transformers config from a shipped short name, a config.json (or a folder holding one), or a hub id.

    Short names (case-insensitive): see `SHIPPED_CONFIGS`. A string that is neither a short name nor an
    existing path, and looks like ``owner/name``, is fetched with `AutoConfig.from_pretrained` (needs the
    Hugging Face hub, or its local cache). A config object is returned as it is.
    """
    if isinstance(name_or_path, PreTrainedConfig):
        return name_or_path
    text = str(name_or_path)
    key = ALIASES.get(text.lower(), text.lower())
    if key in SHIPPED_CONFIGS:
        return _from_pretrained(shipped_config_path(key), text)
    path = Path(text).expanduser()
    if path.is_file():
        return _from_pretrained(path, text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"folder {text!r} has no config.json")
        return _from_pretrained(path, text)
    if _looks_like_hub_id(text):
        return _from_hub(text)
    raise ConfigError(
        f"unknown model {text!r}: not a shipped config, an existing path or a hub id ('owner/name'); "
        f"shipped configs: {', '.join(SHIPPED_CONFIGS)}"
    )


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and not text.endswith(".json")


def _from_pretrained(path: Path, shown: str) -> PreTrainedConfig:
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"cannot read a transformers config from {shown!r}: {error}") from error


def _offline_hint(hub_id: str) -> str:
    """Names the shipped config of the same model (base or instruct, same architecture), if any."""
    repo = hub_id.split("/")[-1].lower()
    same = [
        c.name for c in SHIPPED_CONFIGS.values() if c.hub_id.lower() == hub_id.lower() or repo.startswith(c.name)
    ]
    return f" (shipped offline as {max(same, key=len)!r})" if same else ""


def _from_hub(hub_id: str) -> PreTrainedConfig:
    try:
        return AutoConfig.from_pretrained(hub_id)
    except (OSError, ValueError, KeyError) as error:
        hint = _offline_hint(hub_id)
        raise ConfigError(
            f"cannot load the config of {hub_id!r} from the Hugging Face hub{hint}: {error}; "
            f"shipped configs: {', '.join(SHIPPED_CONFIGS)}"
        ) from error
