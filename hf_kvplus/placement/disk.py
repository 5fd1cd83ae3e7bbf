"""The disk tier: tensors written to files in a folder, read back checked, removed with the cache."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from xxhash import xxh3_64_intdigest as checksum

from ..errors import CorruptFileError, DiskTierError

CHECKSUM = "XXH3-64"  # (measured 46 GB/s on one core, against 3.7 for zlib's CRC-32)


@dataclass(eq=False)
class SpillFile:
    """One file of the tier: its path, its length, the checksum of the bytes it must hold, the version counter of its
    mapped tensor when that checksum was taken (a later version means the tensor was written in place since), and
    whether it was removed (a write still queued for it is then dropped)."""

    path: Path
    nbytes: int
    checksum: int
    version: int
    removed: bool = False


class DiskTier:
    """Files of one offloaded cache in a private folder `kvplus-*` inside `folder`.

    A tensor is written with ordinary file writes, so a full disk is an `OSError` at write time (a `DiskTierError`
    naming the bytes), not a SIGBUS later through a mapping of a sparse file. It is also mapped with
    `torch.from_file(shared=True)`: that tensor stands for the layer at rest (its shape, dtype and bytes) and takes
    a decode step's written region in place. Reading a layer back never goes through the mapping: `read` checks the
    file's length before reading it into memory with plain reads (a short file is a `CorruptFileError`, never a
    SIGBUS) and its checksum before the bytes are used (an altered file is one too, never NaN): XXH3-64. A write into the
    mapping is preceded by `check_size`, which leaves a window of a few instructions in which another process
    truncating the file would still raise SIGBUS. `remove` deletes one file (a layer that was reset or rewritten);
    the private folder goes when the tier is closed or garbage-collected. Nothing is created on disk until the first
    file is written (a cache that never spills leaves no folder behind); a folder that could not be created is
    refused at construction.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        existing = next(p for p in (self.folder, *self.folder.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise DiskTierError(f"the disk tier folder {self.folder} is not usable: {existing} is not a writable folder")
        self._root: Path | None = None
        self._names = itertools.count()
        self._finalizer: weakref.finalize | None = None

    @property
    def root(self) -> Path:
        """The private folder `kvplus-*` inside `folder`, both made on first use."""
        if self._root is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._root = Path(tempfile.mkdtemp(prefix="kvplus-", dir=self.folder))
            except OSError as e:
                raise DiskTierError(f"the disk tier folder {self.folder} is not usable: {e.strerror or e}") from e
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._root, True)
        return self._root

    def __reduce__(self):
        """A copy gets a private folder of its own beside this one (its files are not copied: `Offloaded` refuses to
        copy a tier that holds any)."""
        return DiskTier, (self.folder,)

    def write(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, SpillFile | None]:
        """Writes `tensor` to a new file; returns it memory-mapped (same shape and dtype) and the file's record.

        The mapped tensor is a normal one even under `torch.inference_mode` (its version counter tells writes in
        place from the outside)."""
        data = tensor.detach().contiguous().cpu()
        if data.numel() == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype), None
        raw = data.reshape(-1).view(torch.uint8).numpy()
        path = self.root / f"{next(self._names):06d}-{name}.kv"
        try:
            with open(path, "wb") as f:
                f.write(raw.data)
            with torch.inference_mode(False):
                mapped = torch.from_file(str(path), shared=True, size=raw.nbytes, dtype=torch.uint8)
                mapped = mapped.view(tensor.dtype).view(tensor.shape)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise DiskTierError(
                f"could not write {raw.nbytes} bytes of {name} to {path} ({e.strerror or e}); "
                f"{self.free_bytes()} bytes are free there"
            ) from e
        return mapped, SpillFile(path, raw.nbytes, checksum(raw), mapped._version)

    def read(self, spill: SpillFile, into: torch.Tensor, trust: bool = False) -> None:
        """Reads `spill` into the host tensor `into` (contiguous, `spill.nbytes` bytes) and checks it: its length
        before reading, its checksum after (`trust`: takes the checksum from what was read instead, for a file the
        process itself wrote through the mapping since its last checksum)."""
        buffer = into.view(-1).view(torch.uint8).numpy()
        try:
            fd = os.open(spill.path, os.O_RDONLY)
            try:
                found = os.fstat(fd).st_size
                if found != spill.nbytes:
                    raise self._cut(spill, found)
                done = os.preadv(fd, [buffer], 0)  # (one read, GIL released, for any file under 2 GiB)
                while done < spill.nbytes:
                    n = os.preadv(fd, [memoryview(buffer)[done:]], done)
                    if not n:
                        raise self._cut(spill, done)
                    done += n
            finally:
                os.close(fd)
        except CorruptFileError:
            raise
        except OSError as e:
            raise CorruptFileError(f"could not read the disk tier file {spill.path} ({e.strerror or e})") from e
        found = checksum(buffer)
        if trust:
            spill.checksum = found
        elif found != spill.checksum:
            raise CorruptFileError(
                f"the disk tier file {spill.path} holds other bytes than were written: {CHECKSUM} checksum "
                f"{found:#x}, expected {spill.checksum:#x} (over {spill.nbytes} bytes)"
            )

    @staticmethod
    def check_size(spill: SpillFile) -> bool:
        """Whether the file still has its length (checked right before a write into its mapping)."""
        try:
            return os.stat(spill.path).st_size == spill.nbytes
        except OSError:
            return False

    @staticmethod
    def seal(spill: SpillFile, data: torch.Tensor) -> None:
        """Takes the checksum of `data` (host memory, the file's bytes) as the file's."""
        spill.checksum = checksum(data.detach().contiguous().view(-1).view(torch.uint8).numpy())

    @staticmethod
    def _cut(spill: SpillFile, found: int) -> CorruptFileError:
        return CorruptFileError(
            f"the disk tier file {spill.path} is {found} bytes long, expected {spill.nbytes} (cut short or "
            "overwritten by something else)"
        )

    def free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return 0

    @staticmethod
    def remove(spill: SpillFile | None) -> None:
        if spill is not None:
            spill.removed = True
            spill.path.unlink(missing_ok=True)

    def files(self) -> list[Path]:
        """The files the tier holds now."""
        return sorted(self._root.glob("*.kv")) if self._root is not None and self._root.exists() else []

    def close(self) -> None:
        """Removes the folder and every file in it."""
        if self._finalizer is not None:
            self._finalizer()
