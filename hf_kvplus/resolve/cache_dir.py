"""The user cache folder, and writing into it so that only finished artefacts are ever seen.

The folder is ``$KVPLUS_CACHE`` if set, else ``$XDG_CACHE_HOME/hf_kvplus``, else
``~/.cache/hf_kvplus``. Layout::

    <cache>/models/<name>/        a converted model: config.json, model.safetensors, tokenizer files
    <cache>/texts/austen/<book>.txt
    <cache>/downloads/            files a user fetched by hand (wheels, .gguf, .deb), looked at first
    <cache>/.tmp-*                work in progress; renamed into place when finished

Every artefact is built under a temporary name inside the cache folder and renamed into place when
it is complete, so a fetch that is interrupted leaves a ``.tmp-*`` folder, never a half-written
artefact under its final name, and "does the final path exist" is the whole "already fetched" check.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import FetchError
from ..user_cache import cache_root


def cache_dir(*, create: bool = True) -> Path:
    """The user cache folder (created unless ``create=False``); `user_cache.cache_root`."""
    return cache_root(create=create)


def downloads_dir(*, create: bool = True) -> Path:
    """Where files fetched by hand are looked for before anything is downloaded."""
    path = cache_dir(create=create) / "downloads"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def work_dir(prefix: str = "work") -> Iterator[Path]:
    """A scratch folder inside the cache folder (same file system as the artefacts), always removed."""
    path = Path(tempfile.mkdtemp(prefix=f".tmp-{prefix}-", dir=cache_dir()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def building(final: Path) -> Iterator[Path]:
    """Build the folder ``final`` atomically: yields a temporary folder to fill, renamed to ``final``
    when the ``with`` block ends without an exception, and removed when it raises.

    If another process finished ``final`` first, its copy is kept and ours is dropped.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the artefact gets the usual mode
        if not final.exists():
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():  # not a lost race with another process: a real failure
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run_command(cmd: Sequence[str], *, what: str, by_hand: str, cwd: Path | None = None) -> str:
    """Run ``cmd``; on failure raise :class:`FetchError` naming the command, its output and ``by_hand``."""
    shown = shlex.join(str(part) for part in cmd)
    try:
        done = subprocess.run(
            [str(part) for part in cmd], cwd=cwd, capture_output=True, text=True, check=False
        )
    except OSError as error:  # the program itself is missing
        raise FetchError(f"Could not fetch {what}: tried `{shown}`: {error}. {by_hand}") from error
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip().splitlines()
        tail = "\n".join(output[-8:])
        raise FetchError(
            f"Could not fetch {what}: tried `{shown}` (exit status {done.returncode}):\n{tail}\n{by_hand}"
        )
    return done.stdout
