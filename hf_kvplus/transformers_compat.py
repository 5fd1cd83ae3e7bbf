"""The name Transformers takes the KV cache under: `cache` since 5.24 renamed `past_key_values` (the old
name still works there, with a FutureWarning), `past_key_values` before. The project passes whichever the
installed version takes, so that it runs on both without printing a deprecation warning."""

from __future__ import annotations

import functools
import inspect

from transformers.generation.utils import GenerationMixin


@functools.cache
def cache_kwarg() -> str:
    """"cache" or "past_key_values": the keyword of model forwards and `generate`, their outputs' attribute and
    generate's model_kwargs key. Read off `prepare_inputs_for_generation`, which names it in every version
    (`generate` itself takes it through **kwargs)."""
    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{name: cache}`, to pass a cache to a model forward or `generate` under the name it takes."""
    return {cache_kwarg(): cache}
