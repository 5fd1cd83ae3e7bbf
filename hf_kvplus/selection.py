"""`cache_implementation="kvplus:<spec>"`: hf_kvplus caches selected by name, the way Transformers selects its own
(in `generate(...)`, in a `GenerationConfig` and its `generation_config.json`, through pipelines).

Transformers has no registry of cache implementations: `GenerationConfig.validate` checks the name against the
module constant `ALL_CACHE_IMPLEMENTATIONS`, and `GenerationMixin._prepare_cache_for_generation` builds the cache.
`install()` replaces the constant with the same names in a tuple whose membership test also accepts every
"kvplus:" spec of `hf_kvplus.specs` (parsing it: an unknown or malformed one raises `ConfigError` naming the
accepted ones), and wraps that one function: a "kvplus:" name with no cache given builds that cache from the
model's config, sized for the call's `max_length`; every other call goes to Transformers' function unchanged.
Idempotent; `uninstall()` puts both back. Importing hf_kvplus installs it.
"""

from __future__ import annotations

from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

from .errors import ConfigError, UnsupportedModelError
from .specs import CacheSpec, parse_cache_spec
from .transformers_compat import cache_kwarg

#: What a `cache_implementation` starts with to name an hf_kvplus cache spec.
PREFIX = "kvplus:"


class CacheNames(tuple):
    """Transformers' cache implementation names, and every "kvplus:<spec>" (checked by parsing the spec)."""

    def __contains__(self, name) -> bool:
        if isinstance(name, str) and name.startswith(PREFIX):
            spec(name)
            return True
        return tuple.__contains__(self, name)

    def __add__(self, other):  # `validate` adds "paged" to the names before asking
        return CacheNames(tuple.__add__(self, tuple(other)))


def spec(name: str) -> CacheSpec:
    """The cache spec a "kvplus:<spec>" name gives; `ConfigError` naming the accepted caches otherwise."""
    try:
        return parse_cache_spec(name[len(PREFIX) :])
    except ConfigError as error:
        raise ConfigError(f"cache_implementation={name!r}: {error}") from None


_installed: tuple | None = None  # (Transformers' names, its function) while installed


def install() -> None:
    """Lets `cache_implementation` name hf_kvplus caches ("kvplus:<spec>"). Idempotent."""
    global _installed
    if _installed is not None:
        return
    names = getattr(configuration_utils, "ALL_CACHE_IMPLEMENTATIONS", None)  # (absent: nothing validates names)
    original = GenerationMixin._prepare_cache_for_generation
    key = cache_kwarg()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        name = generation_config.cache_implementation
        if (
            not (isinstance(name, str) and name.startswith(PREFIX))
            or model_kwargs.get(key) is not None  # Transformers refuses a cache and a name together
            or generation_config.use_cache is False
            or not self._supports_default_dynamic_cache()
        ):
            return original(self, generation_config, model_kwargs, *args, **kwargs)
        if self.config.is_encoder_decoder:
            raise UnsupportedModelError(
                f"cache_implementation={name!r}: hf_kvplus caches serve decoder-only models, and "
                f"{type(self).__name__} is an encoder-decoder"
            )
        cache = spec(name).build(self.config, max_length=generation_config.max_length)
        if generation_config.is_assistant:  # as Transformers does for the caches it builds for an assistant
            cache.activate_past_recording()
        model_kwargs[key] = cache

    _prepare_cache_for_generation.__wrapped__ = original
    if names is not None:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = CacheNames(names)
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    _installed = (names, original)


def uninstall() -> None:
    """Gives Transformers back its cache names and cache preparation. Idempotent."""
    global _installed
    if _installed is None:
        return
    names, GenerationMixin._prepare_cache_for_generation = _installed
    if names is not None:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = names
    _installed = None
