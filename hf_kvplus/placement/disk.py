"""The disk tier: tensors written to files in a folder and memory-mapped back, removed with the cache."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from ..errors import DiskTierError


class DiskTier:
    """Files of one offloaded cache in a private folder `kvplus-*` inside `folder`.

    A tensor is written with ordinary file writes, so a full disk is an `OSError` at write time (not a
    SIGBUS later through a mapping of a sparse file), and mapped back with `torch.from_file(shared=True)`:
    writes into the mapped tensor land in the file, and reading it pages the bytes in. `remove` deletes
    one file (a layer that was reset or rewritten); the private folder goes when the tier is closed or
    garbage-collected.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix="kvplus-", dir=folder))
        except OSError as e:
            raise DiskTierError(f"the disk tier folder {folder} is not usable: {e.strerror or e}") from e
        self._names = itertools.count()
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)

    def __reduce__(self):
        """A copy gets a private folder of its own beside this one (its files are not copied: `Offloaded` refuses to
        copy a tier that holds any)."""
        return DiskTier, (self.root.parent,)

    def write(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, Path | None]:
        """Writes `tensor` to a new file and returns it memory-mapped (same shape and dtype) with the path."""
        data = tensor.detach().contiguous().cpu()
        if data.numel() == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype), None
        raw = data.reshape(-1).view(torch.uint8).numpy()
        path = self.root / f"{next(self._names):06d}-{name}.kv"
        try:
            with open(path, "wb") as f:
                f.write(raw.data)
        except OSError as e:
            path.unlink(missing_ok=True)
            free = shutil.disk_usage(self.root).free if self.root.exists() else 0
            raise DiskTierError(
                f"could not write {raw.nbytes} bytes of {name} to {path} ({e.strerror or e}); "
                f"{free} bytes are free there"
            ) from e
        mapped = torch.from_file(str(path), shared=True, size=raw.nbytes, dtype=torch.uint8)
        return mapped.view(tensor.dtype).view(tensor.shape), path

    @staticmethod
    def remove(path: Path | None) -> None:
        if path is not None:
            path.unlink(missing_ok=True)

    def files(self) -> list[Path]:
        """The files the tier holds now."""
        return sorted(self.root.glob("*.kv")) if self.root.exists() else []

    def close(self) -> None:
        """Removes the folder and every file in it."""
        self._finalizer()
