"""Offloaded placement: each layer's K/V rest in host memory (or on disk) and come to the device ahead of use."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from weakref import WeakKeyDictionary

import torch

from ..errors import ConfigError, CorruptFileError, DiskTierError, UnsupportedOperationError
from .base import Placement, TierBytes
from .disk import DiskTier, SpillFile

Tensors = dict[str, torch.Tensor]


@dataclass(eq=False)
class _Rest:
    """What the placement keeps for one storage: its tensors at rest and the copies in flight or in use."""

    rest: Tensors = field(default_factory=dict)  # host (pinned with CUDA) or memory-mapped tensors
    files: dict[str, SpillFile | None] = field(default_factory=dict)  # the disk tier's file of each tensor
    on_disk: bool = False
    fetch: tuple[Tensors, dict[str, int | None], Future | tuple] | None = None  # (source, versions, result)
    installed: Tensors | None = None  # the working copies the storage holds while acquired
    versions: dict[str, int] = field(default_factory=dict)  # their versions when installed
    written: torch.cuda.Event | None = None  # the last write-back to host memory is done


class Offloaded(Placement):
    """K/V at rest in host memory, brought to the accelerator `lookahead` layers ahead of use.

    The cache prefetches the next `lookahead` layers when it updates one, and releases the previous
    layer once its attention has been issued, so at most `lookahead + 1` layers have device copies.
    With CUDA, host tensors are pinned; copies in run on one side stream and write-backs on another,
    ordered by events (a layer's copy in waits for its last write-back, the compute stream waits for
    the copy in, the write-back waits for the compute stream), and device copies are recorded on every
    stream that uses them so the allocator never hands out memory still being read. A write-back
    copies only the regions the storage reports written (one token per decode step for dense and
    packed quantized storage); any other tensor goes back whole if its version counter moved, or
    always under `torch.inference_mode` (whose tensors keep no version counter). Whatever the storage holds crosses the bus
    as it is: packed codes and scales for quantized storage, block tensors for paged storage (the
    block tables stay on the device).

    `host_budget` (bytes) with `folder`: once host memory holds more than the budget, a layer that is
    released goes to memory-mapped files in `folder` (the layer just used is the one needed furthest
    in the future); disk layers are read back ahead of use (on a worker thread with CUDA; without it, where
    a worker would take the compute's cores and GIL, when prefetched). A layer that cannot be
    written (full disk), whether it spills or its grown buffers are rewritten, stays whole in host memory
    and the forward pass goes on, so a full disk never leaves some layers holding a step that others
    lack. When the next forward pass starts, before it changes any layer, the layers left in host memory
    are spilled again; if the disk still cannot take them, that forward raises `DiskTierError` (the bytes
    it could not write, the bytes free) and running it again once space is freed carries on. Files are
    read back checked, length then checksum (`DiskTier.read`): a file cut short or altered is a
    `CorruptFileError` naming it, never a signal or NaN; the layer's data is lost with it, so the cache
    refuses every later use with that error until it is reset. The files go when the cache is reset or
    collected.

    Without CUDA the model's device is host memory: host-tier layers are used in place, and the disk
    tier still works (read ahead into memory, written back in place).
    """

    name = "offloaded"
    moves = True

    def __init__(self, *, lookahead: int = 1, host_budget: int | None = None, folder: str | Path | None = None):
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ConfigError(f"lookahead must be an int >= 0 (layers fetched ahead), got {lookahead!r}")
        if host_budget is not None and (isinstance(host_budget, bool) or not isinstance(host_budget, int) or host_budget < 0):
            raise ConfigError(f"host_budget must be a number of bytes >= 0, got {host_budget!r}")
        if (host_budget is None) != (folder is None):
            raise ConfigError(
                f"the disk tier needs both host_budget and folder (got host_budget={host_budget!r}, folder={folder!r})"
            )
        self.lookahead = lookahead
        self.host_budget = host_budget
        self.disk = DiskTier(folder) if folder is not None else None
        self.device: torch.device | None = None
        self._rests: WeakKeyDictionary = WeakKeyDictionary()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvplus-disk") if self.disk else None
        self._copy_in = self._copy_out = None
        self._failure: DiskTierError | None = None  # a write the disk tier could not make; retried at `begin`
        self._broken: str | None = None  # why the cache lost data (a corrupt file): every later use raises it

    def __repr__(self) -> str:
        disk = f", host_budget={self.host_budget}, folder={str(self.disk.folder)!r}" if self.disk else ""
        return f"Offloaded(lookahead={self.lookahead}{disk})"

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def attach(self, device: torch.device) -> None:
        if self.device is None:
            self.device = torch.device(device)
            if self._cuda:
                self._copy_in = torch.cuda.Stream(self.device)
                self._copy_out = torch.cuda.Stream(self.device)

    def begin(self) -> None:
        """Before a forward pass changes any layer: refuses a cache that lost data, and spills the layers that a
        full disk left in host memory (raising `DiskTierError` if it still cannot)."""
        if self._broken is not None:
            raise CorruptFileError(self._broken)
        if self._failure is not None:
            self._spill_left_behind()

    def gradient_refusal(self) -> str | None:
        if self.disk is None:
            return None
        return (
            f"an offloaded cache with a disk tier (host_budget={self.host_budget} bytes) cannot carry gradients: the "
            "layers it writes to files lose their history; run the forward under torch.no_grad(), or use a lossless "
            "cache that rests in memory (OffloadedCache without folder, DenseCache, PagedCache)"
        )

    def register(self, storage) -> None:
        self._rest(storage)

    def is_acquired(self, storage) -> bool:
        return self._rest(storage).installed is not None

    # ------------------------------------------------------------------ moving in
    def prefetch(self, storage) -> None:
        rest = self._rest(storage)
        if rest.installed is None and rest.fetch is None and self._copies(rest):
            self._start_fetch(rest)

    def acquire(self, storage) -> None:
        if self._broken is not None:
            raise CorruptFileError(self._broken)
        rest = self._rest(storage)
        if rest.installed is not None:
            return
        self._adopt(rest, storage.tensors())
        if not self._copies(rest):  # host memory is the compute device's memory: use in place
            rest.installed, rest.fetch = rest.rest, None
            return
        if rest.fetch is not None and not self._still_current(rest, getattr(storage, "shared_at_rest", False)):
            rest.fetch = None  # the tensors at rest changed since the copy in started (paged copy-on-write)
        if rest.fetch is None:
            self._start_fetch(rest)
        result = rest.fetch[2]
        rest.fetch = None
        try:
            copies, event = result.result() if isinstance(result, Future) else result
        except CorruptFileError as e:
            self._break(str(e))
            raise CorruptFileError(self._broken) from e
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in copies.values():
                t.record_stream(stream)
        storage.load_tensors(copies)
        storage.take_written()  # what it writes from now on is what goes back
        rest.installed = copies
        rest.versions = {name: _version(t) for name, t in copies.items()}

    def _copies(self, rest: _Rest) -> bool:
        return self._cuda or rest.on_disk

    def _start_fetch(self, rest: _Rest) -> None:
        source = dict(rest.rest)
        versions = {name: _version(t) for name, t in source.items()}
        if rest.on_disk:
            files = {}
            for name, spill in rest.files.items():
                if spill is not None:
                    # Its mapped tensor was written in place by others since the checksum was taken (another layer's
                    # block copies, in paged storage): the checksum is taken from the file as it is read.
                    version = source[name]._version
                    files[name], spill.version = (spill, version != spill.version), version
            if self._cuda:
                result = self._reader.submit(self._read, source, files, rest.written)
            else:  # the host is the compute device: a worker thread would take the cores and the GIL from it
                result = Future()
                try:
                    result.set_result(self._read(source, files, None))
                except CorruptFileError as e:
                    result.set_exception(e)  # raised where the layer is acquired
        else:
            result = self._to_device(source, rest.written)
        rest.fetch = (source, versions, result)

    def _read(self, source: Tensors, files: dict[str, tuple[SpillFile, bool]], written) -> tuple[Tensors, torch.cuda.Event | None]:
        """Runs on the reader thread: reads a disk layer's files into memory, checked (pinned, then copied in, with
        CUDA); its tensors not in files (taken from the storage since) are copied."""
        pin, staged = self._cuda, {}
        for name, t in source.items():
            into = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            if name in files:
                spill, trust = files[name]
                self.disk.read(spill, into, trust)
            else:
                into.copy_(t)
            staged[name] = into
        return (staged, None) if not pin else self._to_device(staged, written)

    def _to_device(self, source: Tensors, written) -> tuple[Tensors, torch.cuda.Event]:
        stream = self._copy_in
        with torch.cuda.stream(stream):
            if written is not None:
                stream.wait_event(written)  # no copy in of a host buffer still being written back
            copies = {name: t.to(self.device, non_blocking=True) for name, t in source.items()}
            event = stream.record_event()
        return copies, event

    def _still_current(self, rest: _Rest, shared: bool) -> bool:
        """Whether the tensors at rest are those the copy in started from, unwritten since (unknown versions,
        under inference mode, count as unwritten unless other layers write this storage at rest)."""
        source, versions, _ = rest.fetch
        return source.keys() == rest.rest.keys() and all(
            rest.rest[name] is t and (_version(t) == versions[name] if versions[name] is not None else not shared)
            for name, t in source.items()
        )

    def _adopt(self, rest: _Rest, held: Tensors) -> None:
        """Takes tensors the storage changed while at rest (a paged pool grown by another layer) as its rest."""
        for name in rest.rest.keys() - held.keys():
            self._drop(rest, name)
        for name, t in held.items():
            if rest.rest.get(name) is not t:
                self._drop(rest, name)
                rest.rest[name] = t

    # ------------------------------------------------------------------ moving out
    def release(self, storage) -> None:
        rest = self._rest(storage)
        if rest.installed is None:
            return
        if self.disk is None and not self._copies(rest):
            return  # used in place: nothing to write back, spill or take back (what is at rest is read off the storage)
        held, written = storage.tensors(), storage.take_written()
        if self._copies(rest):
            self._write_back(rest, held, written)
        else:
            for name in rest.rest.keys() - held.keys():
                self._drop(rest, name)
            rest.rest = dict(held)
        rest.installed = None
        storage.load_tensors(rest.rest)
        if getattr(storage, "shared_at_rest", False) and rest.written is not None:
            rest.written.synchronize()  # other layers' block operations touch these tensors at rest
        self._spill_if_over_budget(storage, rest)

    def _write_back(self, rest: _Rest, held: Tensors, written: dict) -> None:
        changed = {}
        for name in rest.rest.keys() - held.keys():
            self._drop(rest, name)
        for name, t in held.items():
            old = rest.rest.get(name)
            same = rest.installed.get(name) is t and old is not None and old.shape == t.shape and old.dtype == t.dtype
            in_tier = not (rest.on_disk and name not in rest.files)
            region = written.get(name) if same and in_tier else None
            version = rest.versions.get(name)
            if region is not None and region[1] >= region[2]:
                continue  # the storage wrote nothing into it
            if same and in_tier and region is None and version is not None and _version(t) == version:
                continue  # unchanged (by its version counter): the bytes at rest are still right
            changed[name] = (t, old, region)
        if not changed:
            return
        if rest.on_disk:
            try:
                self._write_to_disk(rest, changed)
                return
            except DiskTierError as e:  # the layer stays whole in host memory; retried before the next forward
                self._failure = self._failure or e
                for name in list(rest.files):
                    self._drop_file(rest, name)
                rest.on_disk = False
                if not self._copies(rest):
                    rest.rest = dict(held)
                    return
                changed = {name: (t, None, None) for name, t in held.items()}
        self._write_to_host(rest, changed)

    def _write_to_host(self, rest: _Rest, changed: dict) -> None:
        stream = self._copy_out
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the layer's writes and reads
        with torch.cuda.stream(stream):
            for name, (t, old, region) in changed.items():
                if region is not None:
                    old[_index(region)].copy_(t[_index(region)], non_blocking=True)
                else:
                    rest.rest[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t, non_blocking=True)
                t.record_stream(stream)
            rest.written = stream.record_event()

    # ------------------------------------------------------------------ the disk tier
    def _write_to_disk(self, rest: _Rest, changed: dict) -> None:
        """Writes a disk layer's changed tensors: a written region into its file in place (its checksum taken anew
        from the working copy, which the file then equals), anything else as a new file. A
        file found cut short is rewritten whole from the working copy, which holds every byte of it."""
        for name, (t, old, region) in changed.items():
            spill = rest.files.get(name)
            if region is not None and (spill is None or not self.disk.check_size(spill)):
                if spill is not None:
                    warnings.warn(f"the disk tier file {spill.path} is no longer {spill.nbytes} bytes long (something "
                                  "else cut or grew it); rewriting it from the layer in use", RuntimeWarning,
                                  stacklevel=2)  # fmt: skip
                region = None
            if region is None:
                mapped, written = self.disk.write(name, t)  # the new file first: on failure the old one stays
                self._drop(rest, name)
                rest.rest[name], rest.files[name] = mapped, written
            elif self._cuda:
                self._land_later(old, region, t, spill)
            else:
                old[_index(region)] = t[_index(region)]
                spill.version = old._version
                self.disk.seal(spill, t)  # (here: handing it to the reader thread costs more than it takes)

    def _land_later(self, mapped: torch.Tensor, region: tuple[int, int, int], t: torch.Tensor, spill: SpillFile) -> None:
        """Writes a decode step's region of a disk layer without making the host wait for the device: copied
        out to pinned memory on the write-back stream, then written into the mapped file by the reader
        thread once the copy is done. The reader runs one task at a time, in order, so the layer's next
        read from the file comes after it."""
        stream = self._copy_out
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the layer's writes and reads
        with torch.cuda.stream(stream):
            part = t[_index(region)]
            staged = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=True).copy_(part, non_blocking=True)
            t.record_stream(stream)
            done = stream.record_event()
        self._reader.submit(self._land, mapped, region, staged, done, spill)

    def _land(self, mapped: torch.Tensor, region: tuple[int, int, int], staged: torch.Tensor, done, spill: SpillFile) -> None:
        """On the reader thread: a staged region into its mapped file, once its copy out is done; then the file's
        checksum, from the mapping (a file cut short since the release loses the region: the cache is broken)."""
        done.synchronize()
        if spill.removed:  # the layer was rewritten whole or went back to host memory since
            return
        if not self.disk.check_size(spill):
            self._break(f"the disk tier file {spill.path} is no longer {spill.nbytes} bytes long, so a decode step's "
                        "tokens could not be written into it")  # fmt: skip
            return
        mapped[_index(region)] = staged
        spill.version = mapped._version
        self.disk.seal(spill, mapped)

    def _spill_if_over_budget(self, storage, rest: _Rest) -> None:
        if self.disk is None or rest.on_disk or self._failure is not None or self._host_bytes() <= self.host_budget:
            return
        try:
            self._spill(storage, rest)
        except DiskTierError as e:
            self._failure = e  # the layer stays in host memory; spilled again before the next forward changes any

    def _spill(self, storage, rest: _Rest) -> None:
        """Moves a layer at rest in host memory to files (`DiskTierError` if it cannot: it then stays); a layer in use
        keeps its working copies (a loaded one, `__setstate__`)."""
        if rest.written is not None:
            rest.written.synchronize()
        mapped, files = {}, {}
        try:
            for name, t in rest.rest.items():
                mapped[name], files[name] = self.disk.write(name, t)
        except DiskTierError:
            for spill in files.values():
                self.disk.remove(spill)
            raise
        rest.rest, rest.files, rest.on_disk = mapped, files, True
        if rest.installed is None:
            storage.load_tensors(mapped)

    def _spill_left_behind(self) -> None:
        """Spills the layers at rest in host memory past the budget (the last layers first, needed latest), which a
        write that failed left there; raises `DiskTierError` if the disk still cannot take them."""
        failure, self._failure = self._failure, None
        try:
            for storage, rest in reversed(list(self._rests.items())):
                if self._host_bytes() <= self.host_budget:
                    return
                if rest.installed is None and not rest.on_disk and rest.rest:
                    self._spill(storage, rest)
        except DiskTierError as e:
            self._failure = e
            over = self._host_bytes() - self.host_budget
            raise DiskTierError(
                f"{e}. Layers the disk tier could not write stay whole in host memory, {over} bytes past "
                f"host_budget={self.host_budget}, and this forward pass has not changed any layer: free space in "
                f"{self.disk.folder} and run it again"
            ) from failure

    def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = f"{why}; that layer's data is lost, so this cache refuses every use until reset()"

    def _host_bytes(self) -> int:
        return sum(_nbytes(r.rest) for r in self._rests.values() if not r.on_disk)

    def _drop(self, rest: _Rest, name: str) -> None:
        rest.rest.pop(name, None)
        self._drop_file(rest, name)

    def _drop_file(self, rest: _Rest, name: str) -> None:
        if self.disk is not None:
            self.disk.remove(rest.files.pop(name, None))

    # ------------------------------------------------------------------ pickling, copies and saved files
    def __getstate__(self) -> dict:
        """What travels: the tensors at rest and in use, per storage. A prefetch in flight is dropped (the copy
        fetches again), write-backs are waited for, and the streams and the disk reader are made anew. A layer in
        the disk tier's files cannot be pickled or copied (`UnsupportedOperationError`; `save_cache` saves it,
        `__persist_state__`); a disk tier without files travels as a new private folder beside the original's."""
        on_disk = [name for rest in self._rests.values() if rest.on_disk for name in rest.files]
        if on_disk:
            raise UnsupportedOperationError(
                f"this offloaded cache keeps {len(on_disk)} tensors in its disk tier's files in {self.disk.root}, "
                f"which cannot be pickled or copied (host_budget={self.host_budget} bytes); save it with "
                "cache.save(path) and hf_kvplus.load_cache, or build the copy with host_budget large enough to keep "
                "the layers in host memory, or without a disk tier"
            )
        return self._state()

    def __persist_state__(self) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
        """What `save_cache` writes: the state, a disk layer's files included, and the bytes of each file read back
        checked (length, then checksum: `CorruptFileError` for a file cut short or altered, and the cache refuses
        every later use, as when a fetch finds it), which the saved file holds for the file's mapped tensor. A
        loaded copy writes those layers to files of its own tier (`__setstate__`)."""
        if self._broken is not None:
            raise CorruptFileError(self._broken)
        checked = []
        for rest in self._rests.values():
            if not rest.on_disk:
                continue
            if rest.written is not None:
                rest.written.synchronize()
            for name, spill in rest.files.items():
                if spill is None:
                    continue
                mapped = rest.rest[name]
                # (after the reader thread's queued writes into this file, on the reader itself)
                into = self._reader.submit(self._read_file, mapped, spill).result()
                checked.append((mapped, into.view(-1).view(torch.uint8)))
        state = self._state()
        state["_failure"] = None  # (layers a full disk left in host memory are saved there; spilled when released)
        return state, checked

    def _read_file(self, mapped: torch.Tensor, spill: SpillFile) -> torch.Tensor:
        """A disk file's bytes in host memory, checked (its mapped tensor written in place since its checksum was
        taken, as a paged layer's blocks by other layers: the checksum is taken from the file, as a fetch does)."""
        into = torch.empty(mapped.shape, dtype=mapped.dtype)
        trust, spill.version = mapped._version != spill.version, mapped._version
        try:
            self.disk.read(spill, into, trust)
        except CorruptFileError as e:
            self._break(str(e))
            raise CorruptFileError(self._broken) from e
        return into

    def _state(self) -> dict:
        for rest in self._rests.values():
            if rest.written is not None:
                rest.written.synchronize()
        state = dict(self.__dict__)
        state["_rests"] = [(storage, replace(rest, fetch=None, written=None)) for storage, rest in self._rests.items()]
        state["_reader"] = state["_copy_in"] = state["_copy_out"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        """Takes a state that `__getstate__` or `__persist_state__` gave. A layer that was in the disk tier's files
        (a loaded file) is written to files of this placement's own tier (`DiskTierError` if it cannot be), and a
        layer in use writes itself back whole when released (its version counters restarted)."""
        rests = state.pop("_rests")
        self.__dict__.update(state)
        self._rests = WeakKeyDictionary(rests)
        if self.disk is not None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvplus-disk")
        if self._cuda:
            self._copy_in, self._copy_out = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        for storage, rest in rests:
            if rest.installed is not None:
                rest.versions = dict.fromkeys(rest.versions)
            if rest.on_disk:  # (its records name another tier's files, never touched: written anew here)
                rest.files, rest.on_disk = {}, False
                self._spill(storage, rest)

    # ------------------------------------------------------------------ bookkeeping
    def forget(self, storage) -> None:
        rest = self._rests.pop(storage, None)
        if rest is not None and self.disk is not None:
            for spill in rest.files.values():
                self.disk.remove(spill)
        if not self._rests:  # every layer reset: nothing lost or left behind remains
            self._broken = self._failure = None

    def tier_bytes(self, storages: Iterable) -> TierBytes:
        device = host = disk = 0
        for storage in storages:
            rest = self._rest(storage)
            in_use = _nbytes(storage.tensors()) if rest.installed is not None else 0  # as it is now (it may have grown)
            copies = self._copies(rest)
            if copies:
                device += in_use
            if rest.fetch is not None:
                device += _nbytes(rest.fetch[0])  # copies the size of their source are on their way
            resting = _nbytes(rest.rest) if copies else _nbytes(storage.tensors())  # (used in place: as it is now)
            if rest.on_disk:
                disk += resting
            else:
                host += resting
        return TierBytes(device=device, host=host, disk=disk)

    def close(self) -> None:
        """Removes the disk tier's files now (they also go when the placement is collected)."""
        if self.disk is not None:
            self._reader.shutdown(wait=True)
            self.disk.close()

    def _rest(self, storage) -> _Rest:
        rest = self._rests.get(storage)
        if rest is None:
            rest = self._rests[storage] = _Rest()
            rest.rest = dict(storage.tensors())  # raises for a storage that cannot move
        return rest


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter; None for inference-mode tensors, which keep none."""
    return None if t.is_inference() else t._version


def _index(region: tuple[int, int, int]) -> tuple:
    dim, lo, hi = region
    return (slice(None),) * dim + (slice(lo, hi),)


def _nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
