"""Texts by name: the R lazy-load reader, Jane Austen's novels from a Debian package, files, datasets.

The R data here is written by a small serializer in this file, following R's format (serialize.c),
independently of the reader. The real Debian package is fetched only by the `network` test.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import struct
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

from hf_kvplus import ConfigError, KVPlusError
from hf_kvplus.resolve import AUSTEN_BOOKS, FetchError, LazyLoadDB, RDataError, load_text, texts, unserialize
from hf_kvplus.resolve.texts import parse_dataset_spec

# -- an R serializer (XDR, format versions 2 and 3), written from the format's description ---------

NIL, LIST, CHAR, LGL, INT, REAL, STR, VEC, ALTREP, REF = 254, 2, 9, 10, 13, 14, 16, 19, 238, 255
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
ASCII, UTF8, LATIN1 = 64 << 12, 8 << 12, 4 << 12
NA_INT = -(2**31)


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


class RSerializer:
    """Builds the bytes of one serialized R object; symbols are written once, then referenced."""

    def __init__(self, version: int = 3, packed_refs: bool = True):
        self.version = version
        self.packed_refs = packed_refs
        self.symbols: list[str] = []

    def header(self) -> bytes:
        head = b"X\n" + i32(self.version, 0x040201, 0x020300 if self.version == 2 else 0x030500)
        return head + (i32(5) + b"UTF-8" if self.version == 3 else b"")

    def doc(self, body: bytes) -> bytes:
        return self.header() + body

    def char(self, s: str | None, encoding: str = "utf-8") -> bytes:
        if s is None:
            return i32(CHAR, -1)
        raw = s.encode(encoding)
        level = ASCII if raw.isascii() else (LATIN1 if encoding == "latin-1" else UTF8)
        return i32(CHAR | level, len(raw)) + raw

    def sym(self, name: str) -> bytes:
        if name in self.symbols:
            index = self.symbols.index(name) + 1
            return i32((index << 8) | REF) if self.packed_refs else i32(REF, index)
        self.symbols.append(name)
        return i32(1) + self.char(name)

    def attrs(self, attributes: dict[str, bytes]) -> bytes:
        cells = b"".join(i32(LIST | HAS_TAG) + self.sym(k) + v for k, v in attributes.items())
        return cells + i32(NIL)

    def _vector(self, kind: int, n: int, payload: bytes, attributes: dict | None) -> bytes:
        flags = kind | (HAS_ATTR if attributes else 0)
        return i32(flags, n) + payload + (self.attrs(attributes) if attributes else b"")

    def strs(self, items, attributes=None, encoding="utf-8") -> bytes:
        return self._vector(STR, len(items), b"".join(self.char(s, encoding) for s in items), attributes)

    def ints(self, items, attributes=None) -> bytes:
        return self._vector(INT, len(items), i32(*[NA_INT if x is None else x for x in items]), attributes)

    def lgls(self, items, attributes=None) -> bytes:
        return self._vector(
            LGL, len(items), i32(*[NA_INT if x is None else int(x) for x in items]), attributes
        )

    def reals(self, items, attributes=None) -> bytes:
        return self._vector(REAL, len(items), struct.pack(f">{len(items)}d", *items), attributes)

    def vec(self, items: list[bytes], attributes=None) -> bytes:
        return self._vector(VEC, len(items), b"".join(items), attributes)

    def named_vec(self, mapping: dict[str, bytes]) -> bytes:
        # R writes a list's elements first, then its attributes: build the names after the items.
        items = b"".join(mapping.values())
        return i32(VEC | HAS_ATTR, len(mapping)) + items + self.attrs({"names": self.strs(list(mapping))})


def write_lazyload(
    folder: Path, objects: dict[str, bytes], compression: int = 1, method: bytes = b"Z"
) -> Path:
    """Write ``Rdata.rdb``/``Rdata.rdx`` as R's makeLazyLoadDB does; ``objects`` are serialized documents."""
    compressors = {
        b"Z": lambda d: lzma.compress(d, format=lzma.FORMAT_XZ),
        b"2": bz2.compress,
        b"1": zlib.compress,
        b"0": bytes,
    }
    rdb = bytearray()
    offsets = {}
    for name, data in objects.items():
        if compression == 1:
            blob = struct.pack(">I", len(data)) + zlib.compress(data)
        else:
            blob = struct.pack(">I", len(data)) + method + compressors[method](data)
        offsets[name] = (len(rdb), len(blob))
        rdb += blob
    ser = RSerializer()
    variables = ser.named_vec({name: ser.ints(list(where)) for name, where in offsets.items()})
    references = ser.vec([], attributes={"names": ser.strs([])})
    flag = ser.lgls([True]) if compression == 1 else ser.reals([float(compression)])
    index = ser.header() + i32(VEC | HAS_ATTR, 3) + variables + references + flag
    index += ser.attrs({"names": ser.strs(["variables", "references", "compressed"])})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Rdata.rdb").write_bytes(bytes(rdb))
    (folder / "Rdata.rdx").write_bytes(gzip.compress(index))
    return folder / "Rdata"


def book_lines(book: str) -> list[str | None]:
    return [book.upper(), "", f"Chapter 1 of {book}", "", "It cost £5 — café", None, "The end."]


def austen_objects() -> dict[str, bytes]:
    objects = {}
    for book in AUSTEN_BOOKS:
        ser = RSerializer()
        objects[book] = ser.doc(ser.strs(book_lines(book)))
    return objects


# -- the reader ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("compression", "method"), [(1, b"1"), (2, b"2"), (3, b"Z"), (3, b"0")])
def test_lazyload_database_round_trip(tmp_path, compression, method):
    ser = RSerializer()
    table = ser.doc(
        ser.named_vec(
            {
                "words": ser.strs(["plain", "naïve £", None]),
                "counts": ser.ints([1, None, -7]),
                "flags": ser.lgls([True, False, None]),
                "scores": ser.reals([0.5, -2.25]),
                "nested": ser.named_vec({"inner": ser.strs(["x"])}),  # "names" symbol now a reference
            }
        )
    )
    latin = RSerializer()
    objects = {"table": table, "latin": latin.doc(latin.strs(["déjà vu"], encoding="latin-1"))}
    db = LazyLoadDB(write_lazyload(tmp_path / "data", objects, compression, method))

    assert db.names() == ["table", "latin"] and db.compression == compression
    value = db["table"]
    assert value.rtype == "list" and value.names == ["words", "counts", "flags", "scores", "nested"]
    parts = value.as_dict()
    assert parts["words"] == ["plain", "naïve £", None] and parts["words"].rtype == "character"
    assert parts["counts"] == [1, None, -7] and parts["counts"].rtype == "integer"
    assert parts["flags"] == [True, False, None]
    assert parts["scores"] == [0.5, -2.25]
    assert parts["nested"].as_dict() == {"inner": ["x"]}
    assert db["latin"] == ["déjà vu"]


@pytest.mark.parametrize("version", [2, 3])
def test_unserialize_versions_and_unpacked_references(version):
    ser = RSerializer(version=version, packed_refs=False)
    doc = ser.doc(
        ser.vec([ser.strs(["a"], {"names": ser.strs(["n"])}), ser.ints([2], {"names": ser.strs(["m"])})])
    )
    value = unserialize(doc)
    assert value[0] == ["a"] and value[0].names == ["n"]
    assert value[1] == [2] and value[1].names == ["m"]


def test_long_pairlist_does_not_recurse_per_cell():
    ser = RSerializer()
    cells = b"".join(i32(LIST) + ser.ints([i]) for i in range(5000))
    value = unserialize(ser.doc(cells + i32(NIL)))
    assert len(value) == 5000 and value[4999] == (None, [4999])


def test_altrep_compact_sequence_is_expanded():
    ser = RSerializer()
    info = (
        i32(LIST)
        + ser.sym("compact_intseq")
        + i32(LIST)
        + ser.sym("base")
        + i32(LIST)
        + ser.ints([13])
        + i32(NIL)
    )
    body = i32(ALTREP) + info + ser.reals([4.0, 10.0, 1.0]) + i32(NIL)
    value = unserialize(ser.doc(body))
    assert value == [10, 11, 12, 13] and value.rtype == "integer"


def test_reader_errors_are_typed_and_say_what_is_wrong(tmp_path):
    ser = RSerializer()
    doc = ser.doc(ser.strs(["abc", "def"]))
    with pytest.raises(RDataError, match="truncated"):
        unserialize(doc[:-2])
    with pytest.raises(RDataError, match="ASCII"):
        unserialize(b"A\n1\n")
    with pytest.raises(RDataError, match="does not exist"):
        LazyLoadDB(tmp_path / "nowhere" / "Rdata")
    db = LazyLoadDB(write_lazyload(tmp_path / "data", {"only": doc}))
    with pytest.raises(KeyError, match=r"'missing' is not in Rdata.rdb; it holds \['only'\]"):
        db["missing"]
    assert issubclass(RDataError, KVPlusError)


# -- Jane Austen from a Debian package -------------------------------------------------------------


def make_deb(path: Path, rdata: Path) -> Path:
    """A minimal .deb (ar archive: debian-binary, control.tar.gz, data.tar.xz) holding the R data."""

    def tar_bytes(files: dict[str, bytes], mode: str) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode=mode) as archive:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
        return buffer.getvalue()

    control = b"Package: r-cran-janeaustenr\nVersion: 1.0.0-1\nArchitecture: all\nMaintainer: t <t@t>\nDescription: t\n"
    prefix = "./usr/lib/R/site-library/janeaustenr/data/"
    data = {
        prefix + "Rdata.rdb": rdata.with_suffix(".rdb").read_bytes(),
        prefix + "Rdata.rdx": rdata.with_suffix(".rdx").read_bytes(),
    }
    members = [
        ("debian-binary", b"2.0\n"),
        ("control.tar.gz", tar_bytes({"./control": control}, "w:gz")),
        ("data.tar.xz", tar_bytes(data, "w:xz")),
    ]
    out = bytearray(b"!<arch>\n")
    for name, blob in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(blob):<10}`\n".encode()
        out += blob + (b"\n" if len(blob) % 2 else b"")
    path.write_bytes(bytes(out))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder, and no installed R package to find."""
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(texts, "_r_library_dirs", lambda: [])
    return tmp_path / "cache"


@pytest.mark.parametrize("extractor", ["default", "stdlib"])
def test_austen_from_a_deb_put_by_hand_is_cached_as_plain_text(cache, tmp_path, monkeypatch, extractor):
    if extractor == "stdlib":  # as on a machine without dpkg-deb
        real_which = texts.shutil.which
        monkeypatch.setattr(
            texts.shutil, "which", lambda name: None if name == "dpkg-deb" else real_which(name)
        )
    rdata = write_lazyload(tmp_path / "r" / "data", austen_objects())
    (cache / "downloads").mkdir(parents=True)
    deb = make_deb(cache / "downloads" / "r-cran-janeaustenr_1.0.0-1_all.deb", rdata)

    text = load_text("austen:prideprejudice")
    assert text == "\n".join(line or "" for line in book_lines("prideprejudice"))
    assert sorted(p.name for p in (cache / "texts" / "austen").glob("*.txt")) == sorted(
        f"{b}.txt" for b in AUSTEN_BOOKS
    )
    assert not list(cache.glob(".tmp-*")) and not list((cache / "texts").glob(".tmp-*"))

    deb.unlink()  # a second run reads the cached text and fetches nothing
    monkeypatch.setattr(texts, "_apt_download", lambda work: pytest.fail("fetched again"))
    assert load_text("austen:emma").startswith("EMMA\n\nChapter 1 of emma")


def test_austen_from_an_installed_r_package(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLUS_CACHE", str(tmp_path / "cache"))
    library = tmp_path / "Rlib"
    write_lazyload(library / "janeaustenr" / "data", austen_objects())
    monkeypatch.setenv("R_LIBS", str(library))
    monkeypatch.setattr(texts, "_apt_download", lambda work: pytest.fail("downloaded although installed"))
    assert load_text("austen:persuasion").splitlines()[0] == "PERSUASION"
    assert "installed R package" in (tmp_path / "cache" / "texts" / "austen" / "SOURCE").read_text()


@pytest.mark.skipif(sys.platform == "win32", reason="a shell-script stand-in for apt-get")
def test_failed_download_says_what_was_tried_and_how_to_supply_it(cache, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    fake = bin_dir / "apt-get"
    fake.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = update ] && exit 0\necho "E: Unable to locate package r-cran-janeaustenr" >&2\nexit 100\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))

    with pytest.raises(FetchError) as caught:
        load_text("austen:emma")
    message = str(caught.value)
    assert "`apt-get download r-cran-janeaustenr`" in message and "Unable to locate package" in message
    assert f"put the r-cran-janeaustenr_*.deb file in {cache / 'downloads'}" in message
    expected = ["download r-cran-janeaustenr"]
    if os.geteuid() == 0:  # root refreshes the package lists once, then retries
        expected += ["update", "download r-cran-janeaustenr"]
    assert log.read_text().splitlines() == expected
    assert not (cache / "texts" / "austen").exists() and not list((cache / "texts").glob(".tmp-*"))


def test_missing_apt_get_is_reported(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FetchError, match=r"`apt-get download r-cran-janeaustenr` needs apt-get.*by hand"):
        load_text("austen:emma")


# -- other specs -----------------------------------------------------------------------------------


def test_local_file(tmp_path):
    path = tmp_path / "story.txt"
    path.write_text("Once upon a time — ünïcode\nThe end.\n", encoding="utf-8")
    assert load_text(str(path)) == "Once upon a time — ünïcode\nThe end.\n"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("austen:ulysses", r"Unknown Austen book 'ulysses'; available: sensesensibility, prideprejudice"),
        ("prideprejudice", r"Did you mean 'austen:prideprejudice'\?"),
        ("no/such/file.txt", r"no such file.*'austen:<book>'.*hf:<dataset>"),
        ("", r"non-empty string"),
        ("hf:a:b:c:d", r"expected 'hf:<dataset>\[:<config>\]\[:<split>\]\[#<rows>\]'"),
        ("hf:wikitext#0", r"positive integer"),
    ],
)
def test_bad_specs_name_the_accepted_forms(spec, match):
    with pytest.raises(ConfigError, match=match):
        load_text(spec)


def test_dataset_spec_parsing():
    assert parse_dataset_spec("deepmind/pg19::test") == ("deepmind/pg19", None, "test", None)
    assert parse_dataset_spec("wikitext:wikitext-103-raw-v1:validation#5") == (
        "wikitext",
        "wikitext-103-raw-v1",
        "validation",
        5,
    )
    assert parse_dataset_spec("pg19") == ("pg19", None, "test", None)


def test_local_dataset_folder(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "test.jsonl").write_text('{"text": "first row"}\n{"text": "second"}\n{"text": "third"}\n')
    assert load_text(f"hf:{folder}") == "first row\nsecond\nthird"
    assert load_text(f"hf:{folder}::test#2") == "first row\nsecond"
    with pytest.raises(FetchError, match=r"tried `datasets.load_dataset\(.*split='train'\)`.*Unknown split"):
        load_text(f"hf:{folder}::train")


# -- the real package (network: apt-get download from a Debian mirror) ----------------------------


@pytest.mark.network
def test_real_janeaustenr_package(cache):
    text = load_text("austen:prideprejudice")
    lines = text.split("\n")
    assert lines[0] == "PRIDE AND PREJUDICE" and len(lines) == 13030
    assert "It is a truth universally acknowledged, that a single man in possession" in text
    sizes = {book: len(load_text(f"austen:{book}")) for book in AUSTEN_BOOKS}
    assert all(size > 400_000 for size in sizes.values()), sizes
    assert "apt-get download r-cran-janeaustenr" in (cache / "texts" / "austen" / "SOURCE").read_text()
