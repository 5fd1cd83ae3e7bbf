"""Budgets: a token count, or the share of the prompt an evicting cache keeps.

`budget=1024` keeps 1024 tokens per KV head; `budget=0.2` keeps a fifth of the prompt, as kvpress's
`compression_ratio=0.8` (named here for what is kept, not what is dropped). A fraction becomes a token count once, when
the cache's first forward arrives (the prompt, before any layer changes): `int(fraction x n)`, at least 1, where n is
that forward's tokens per row, padding included, the same count for every row of a batch (kvpress's presses count
`int(k_len x (1 - compression_ratio))` over the prefill's keys, padding included, the same way). From then on the cache
is the one built with that count; `reset()` makes it a fraction again, resolved at the next prompt.
"""

from __future__ import annotations

from ..errors import ConfigError


def check_budget(budget, what: str = "budget") -> int | float:
    """`budget` as given: an int >= 1 (tokens) or a float in (0, 1] (the share of the prompt kept)."""
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ConfigError(f"{what} is a token count (int >= 1) or a share of the prompt (float in (0, 1]), got "
                          f"{budget!r}")  # fmt: skip
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ConfigError(f"{what}={budget} as a share of the prompt must be in (0, 1] (an int is a token count)")
    if isinstance(budget, int) and budget < 1:
        raise ConfigError(f"the {what} must hold at least 1 token, got {what}={budget} (a float in (0, 1] is a share "
                          "of the prompt)")  # fmt: skip
    return budget


def prompt_share(fraction: float, prompt: int) -> int:
    """The tokens a `fraction` of a `prompt`-token forward keeps: int(fraction x prompt), at least 1."""
    return max(1, int(fraction * prompt))
