"""A folder of stored blocks, shared by every process (and machine, on a shared filesystem) that opens it.

One file per block, `<scope>/<first two hex digits>/<key>.kvb`. A block is written to a temporary file in the folder
and renamed into place, so a reader opens either nothing or a whole file; records are checked when read
(`block_record`), so even a file damaged on disk is refused. The folder is bounded by `max_bytes`: after writes, the
least recently used files (by modification time, which a read refreshes) are removed under an exclusive `flock` on
`.lock`, one process at a time. A reader that opened a file before its removal reads it whole.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ConfigError, DiskTierError

SUFFIX = ".kvb"


class FolderBlocks:
    """Stored blocks as files under `root`, at most `max_bytes` of them (None: unbounded)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ConfigError(f"max_bytes must be None or an int >= 0, got {max_bytes!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"FolderBlocks({str(self.root)!r}, max_bytes={self.max_bytes})"

    def _path(self, key: str) -> Path:
        scope, _, name = key.rpartition("/")
        return self.root / scope / name[:2] / (name + SUFFIX)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data

    def touch(self, keys: list[str]) -> None:
        """Marks the blocks used, in the order given (the last one most recently)."""
        for key in keys:
            try:
                os.utime(self._path(key))
            except FileNotFoundError:  # removed by another process since: a later lookup misses it
                pass

    def put(self, items: list[tuple[str, bytes]]) -> None:
        """Writes each (key, record) atomically, then trims the folder to `max_bytes`. A write that fails (a full disk)
        raises `DiskTierError` naming the bytes and the bytes free; the records written before it stay, whole."""
        for key, data in items:
            path = self._path(key)
            tmp = None
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
                with open(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException as e:
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)
                if isinstance(e, OSError):
                    raise DiskTierError(
                        f"could not write the {len(data)} bytes of block {key} to {path.parent} ({e.strerror or e}); "
                        f"{_free_bytes(self.root)} bytes are free there"
                    ) from e
                raise
        if self.max_bytes is not None and items:
            self.trim(self.max_bytes)

    def discard(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def trim(self, max_bytes: int) -> int:
        """Removes least recently used blocks until the folder holds at most `max_bytes`; returns how many."""
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            files = []
            for path in self.root.glob(f"*/*/*{SUFFIX}"):
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                files.append((stat.st_mtime_ns, stat.st_size, path))
            total, removed = sum(size for _, size, _ in files), 0
            for _, size, path in sorted(files):
                if total <= max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= size
                removed += 1
            return removed

    def nbytes(self) -> int:
        """Bytes of the stored blocks now."""
        return sum(p.stat().st_size for p in self.root.glob(f"*/*/*{SUFFIX}") if p.exists())


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0
