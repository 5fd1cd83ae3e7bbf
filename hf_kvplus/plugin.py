"""Everything importing hf_kvplus changes in Transformers, behind one `install()` and one `uninstall()`: the
attention route (`attention.dispatch`) and cache selection by name (`selection`)."""

from __future__ import annotations

from . import selection
from .attention import install as install_attention
from .attention import uninstall as uninstall_attention


def install() -> None:
    """Registers the "kvplus" attention, routes "sdpa" for hf_kvplus caches, and lets `cache_implementation` name
    hf_kvplus caches ("kvplus:<spec>"). Idempotent; importing hf_kvplus calls it."""
    install_attention()
    selection.install()


def uninstall() -> None:
    """Undoes `install()` (the "kvplus" attention name stays registered). Idempotent."""
    uninstall_attention()
    selection.uninstall()
