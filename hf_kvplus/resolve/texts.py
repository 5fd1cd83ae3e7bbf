"""Long texts for evaluations, by name: Jane Austen's novels offline, local files, `datasets` datasets.

``load_text(spec)`` accepts:

- ``austen:<book>``: one of Jane Austen's six novels (:data:`AUSTEN_BOOKS`), from the Debian package
  ``r-cran-janeaustenr`` (``apt-get download``, ``dpkg-deb -x``, then its R lazy-load database
  ``data/Rdata.rdb`` read by :mod:`hf_kvplus.resolve.rdata`). The six books are written once as plain
  text to ``<cache>/texts/austen/<book>.txt``; later calls read those files.
- a path to a local file: its text (UTF-8).
- ``hf:<path>[:<config>][:<split>][#<rows>]``: a `datasets` dataset (hub id or local folder), its
  ``text`` column, rows joined with newlines; split ``test`` unless given; ``#<rows>`` keeps the
  first rows only. ``hf:deepmind/pg19::test#1``, ``hf:wikitext:wikitext-103-raw-v1:test``.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

from hf_kvplus.errors import ConfigError

from .cache_dir import FetchError, building, cache_dir, downloads_dir, run_command, work_dir
from .rdata import LazyLoadDB, RDataError

AUSTEN_BOOKS: dict[str, str] = {
    "sensesensibility": "Sense and Sensibility (1811)",
    "prideprejudice": "Pride and Prejudice (1813)",
    "mansfieldpark": "Mansfield Park (1814)",
    "emma": "Emma (1815)",
    "northangerabbey": "Northanger Abbey (1817)",
    "persuasion": "Persuasion (1817)",
}

DEBIAN_PACKAGE = "r-cran-janeaustenr"
R_PACKAGE = "janeaustenr"
# Where an installed R package would be (Debian's r-cran-* packages, CRAN installs); R_LIBS* first.
_R_LIBRARY_DIRS = (
    "/usr/lib/R/site-library",
    "/usr/local/lib/R/site-library",
    "/usr/lib/R/library",
    "/usr/local/lib/R/library",
    "/opt/homebrew/lib/R/library",
    "/Library/Frameworks/R.framework/Resources/library",
)

SPEC_FORMS = (
    "'austen:<book>' (books: " + ", ".join(AUSTEN_BOOKS) + "), "
    "a path to a local text file, or 'hf:<dataset>[:<config>][:<split>][#<rows>]' "
    "(e.g. 'hf:wikitext:wikitext-103-raw-v1:test')"
)


def load_text(spec: str) -> str:
    """The text named by ``spec`` (see the module docstring for the accepted forms)."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"A text spec must be a non-empty string, got {spec!r}. Accepted: {SPEC_FORMS}.")
    if spec.startswith("austen:"):
        return austen_text(spec[len("austen:") :])
    if spec.startswith("hf:"):
        return dataset_text(spec[len("hf:") :])
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    hint = ""
    if spec in AUSTEN_BOOKS:
        hint = f" Did you mean 'austen:{spec}'?"
    elif path.exists():
        hint = f" {str(path)!r} exists but is not a file."
    raise ConfigError(
        f"Unknown text {spec!r}: not a spec form and no such file.{hint} Accepted: {SPEC_FORMS}."
    )


# -- Jane Austen ---------------------------------------------------------------------------------


def austen_dir() -> Path:
    """The folder of the six books as plain text (``<cache>/texts/austen``), fetching them if needed."""
    final = cache_dir() / "texts" / "austen"
    if not all((final / f"{book}.txt").is_file() for book in AUSTEN_BOOKS):
        if final.exists():  # an older or damaged copy: rebuild it
            shutil.rmtree(final)
        with building(final) as tmp:
            _write_austen_books(tmp)
    return final


def austen_text(book: str) -> str:
    """One of Jane Austen's six novels, its lines joined with newlines."""
    if book not in AUSTEN_BOOKS:
        raise ConfigError(
            f"Unknown Austen book {book!r}; available: {', '.join(AUSTEN_BOOKS)} "
            f"(as 'austen:<book>'). Accepted text specs: {SPEC_FORMS}."
        )
    return (austen_dir() / f"{book}.txt").read_text(encoding="utf-8")


def _write_austen_books(out: Path) -> None:
    with work_dir("janeaustenr") as work:
        data_dir, source = _janeaustenr_data_dir(work)
        try:
            db = LazyLoadDB(data_dir / "Rdata")
            missing = [book for book in AUSTEN_BOOKS if book not in db]
            if missing:
                raise RDataError(f"{data_dir / 'Rdata.rdb'} lacks {missing}; it holds {db.names()}")
            for book in AUSTEN_BOOKS:
                lines = db[book]
                text = "\n".join("" if line is None else str(line) for line in lines)
                (out / f"{book}.txt").write_text(text, encoding="utf-8", newline="")
        except RDataError as error:
            raise FetchError(f"Could not read Jane Austen's novels from {source}: {error}") from error
        (out / "SOURCE").write_text(f"{source}\n", encoding="utf-8")


def _janeaustenr_data_dir(work: Path) -> tuple[Path, str]:
    """``(folder holding Rdata.rdb/.rdx, where it came from)``: an installed R package, a .deb put in
    the downloads folder by hand, or ``apt-get download``."""
    for library in _r_library_dirs():
        data = library / R_PACKAGE / "data"
        if (data / "Rdata.rdb").is_file() and (data / "Rdata.rdx").is_file():
            return data, f"the installed R package at {data.parent}"
    by_hand = sorted(downloads_dir().glob(f"{DEBIAN_PACKAGE}_*.deb"))
    deb = by_hand[-1] if by_hand else _apt_download(work)
    extracted = work / "extracted"
    _extract_deb(deb, extracted)
    matches = sorted(extracted.glob(f"usr/lib/R/*/{R_PACKAGE}/data/Rdata.rdb"))
    if not matches:
        raise FetchError(
            f"{deb.name} holds no {R_PACKAGE}/data/Rdata.rdb under usr/lib/R/. {_by_hand_hint()}"
        )
    source = f"`apt-get download {DEBIAN_PACKAGE}` ({deb.name})" if deb.parent == work else str(deb)
    return matches[0].parent, source


def _r_library_dirs() -> list[Path]:
    dirs = []
    for var in ("R_LIBS", "R_LIBS_USER", "R_LIBS_SITE"):
        dirs += [Path(p).expanduser() for p in os.environ.get(var, "").split(os.pathsep) if p]
    return dirs + [Path(p) for p in _R_LIBRARY_DIRS]


def _by_hand_hint() -> str:
    return (
        f"To supply it by hand: run `apt-get download {DEBIAN_PACKAGE}` (after `sudo apt-get update` if "
        f"apt cannot find it) on any Debian/Ubuntu machine, or download the .deb from "
        f"https://packages.debian.org/stable/{DEBIAN_PACKAGE}, and put the {DEBIAN_PACKAGE}_*.deb file in "
        f"{downloads_dir(create=False)} (set KVPLUS_CACHE to move the cache folder); or install the R "
        f"package {R_PACKAGE}; or pass the path of a local text file instead."
    )


def _apt_download(work: Path) -> Path:
    cmd = ["apt-get", "download", DEBIAN_PACKAGE]
    if shutil.which("apt-get") is None:
        raise FetchError(
            f"Could not fetch Jane Austen's novels: `{' '.join(cmd)}` needs apt-get, which is not on "
            f"this machine. {_by_hand_hint()}"
        )
    try:
        run_command(cmd, what=f"the Debian package {DEBIAN_PACKAGE}", by_hand=_by_hand_hint(), cwd=work)
    except FetchError as first:
        if getattr(os, "geteuid", lambda: -1)() != 0:  # apt-get update needs root: leave it to the user
            raise
        # The package lists may be missing or stale (fresh containers ship none): refresh, retry once.
        try:
            run_command(["apt-get", "update"], what="the Debian package lists", by_hand="")
        except FetchError as update_failed:
            raise FetchError(f"{first}\nRefreshing the package lists did not help: {update_failed}") from None
        run_command(cmd, what=f"the Debian package {DEBIAN_PACKAGE}", by_hand=_by_hand_hint(), cwd=work)
    debs = sorted(work.glob(f"{DEBIAN_PACKAGE}_*.deb"))
    if not debs:
        raise FetchError(
            f"`{' '.join(cmd)}` succeeded but left no {DEBIAN_PACKAGE}_*.deb in {work}. {_by_hand_hint()}"
        )
    return debs[-1]


def _extract_deb(deb: Path, dest: Path) -> None:
    """``dpkg-deb -x deb dest``; where dpkg-deb is missing, the same with the standard library
    (a .deb is an ``ar`` archive whose ``data.tar.*`` member holds the files)."""
    dest.mkdir(parents=True, exist_ok=True)
    if shutil.which("dpkg-deb"):
        run_command(["dpkg-deb", "-x", deb, dest], what=f"the files of {deb.name}", by_hand=_by_hand_hint())
        return
    try:
        member = _ar_member(deb, "data.tar")
        with tarfile.open(fileobj=member, mode="r:*") as archive:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12: refuse paths outside dest
                archive.extractall(dest, filter="data")
            else:
                archive.extractall(dest)
    except (OSError, tarfile.TarError, ValueError) as error:
        raise FetchError(
            f"Could not unpack {deb} (no dpkg-deb; read as ar + tar): {error}. {_by_hand_hint()}"
        ) from error


def _ar_member(path: Path, prefix: str) -> io.BytesIO:
    data = path.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise ValueError(f"{path.name} is not an ar archive")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        if name.startswith(prefix):
            return io.BytesIO(data[pos + 60 : pos + 60 + size])
        pos += 60 + size + (size % 2)
    raise ValueError(f"{path.name} has no {prefix}* member")


# -- datasets --------------------------------------------------------------------------------------


def parse_dataset_spec(rest: str) -> tuple[str, str | None, str, int | None]:
    """``"<path>[:<config>][:<split>][#<rows>]"`` -> ``(path, config or None, split, rows or None)``."""
    rows = None
    if "#" in rest:
        rest, _, count = rest.rpartition("#")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"Row limit '#{count}' in 'hf:{rest}#{count}' must be a positive integer.")
        rows = int(count)
    parts = rest.split(":")
    if len(parts) > 3 or not parts[0]:
        raise ConfigError(
            f"Bad dataset spec 'hf:{rest}': expected 'hf:<dataset>[:<config>][:<split>][#<rows>]', "
            f"e.g. 'hf:deepmind/pg19::test' or 'hf:wikitext:wikitext-103-raw-v1:test'."
        )
    path = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "test"
    return path, config, split, rows


def dataset_text(rest: str) -> str:
    """The ``text`` column of a `datasets` dataset, rows joined with newlines (``rest`` follows ``hf:``)."""
    path, config, split, rows = parse_dataset_spec(rest)
    try:
        import datasets
    except ImportError as error:
        raise ConfigError(
            "'hf:' text specs need the `datasets` package: pip install 'hf-kvplus[eval]' (or datasets)."
        ) from error
    split_expr = f"{split}[:{rows}]" if rows else split
    call = f"datasets.load_dataset({path!r}, {config!r}, split={split_expr!r})"
    try:
        data = datasets.load_dataset(path, config, split=split_expr)
    except Exception as error:  # hub unreachable, unknown dataset/config/split...
        raise FetchError(
            f"Could not load the dataset for 'hf:{rest}': tried `{call}`: {type(error).__name__}: {str(error).rstrip('.')}. "
            f"Offline, pass a local dataset folder as the path, or a local text file instead of 'hf:...'."
        ) from error
    if "text" not in data.column_names:
        raise ConfigError(f"`{call}` has no 'text' column; its columns are {data.column_names}.")
    return "\n".join("" if row is None else row for row in data["text"])
