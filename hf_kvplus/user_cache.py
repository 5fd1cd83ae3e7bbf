"""The user cache folder: ``$KVPLUS_CACHE`` if set, else ``$XDG_CACHE_HOME/hf_kvplus``, else ``~/.cache/hf_kvplus``.

Converted models and texts (`resolve`) and artifacts fitted to a model (`fitted`) live under it. It sits at the bottom
of the package so that a cache can find its model's artifacts without importing the fetching code.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "KVPLUS_CACHE"


def cache_root(*, create: bool = True) -> Path:
    """The user cache folder (created unless ``create=False``)."""
    if os.environ.get(ENV_VAR):
        root = Path(os.environ[ENV_VAR]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hf_kvplus"
    else:
        root = Path.home() / ".cache" / "hf_kvplus"
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return root
