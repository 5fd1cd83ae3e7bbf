"""A prefix store that outlives the process: `PagedPool(prefix_backend=...)` on a folder or a Redis/Valkey server.

A pool opened later on the same back end (another process, here also a second pool in this one) reuses the blocks a
first one stored, and generates the same tokens as a fresh prefill; quantized blocks stay quantized on the back end;
a tenant never reads another's blocks (the keys it asks for are never ones another wrote); a damaged record is
refused and dropped; the folder stays within its bytes, least recently used first; several processes writing and
reading one prefix at once never read a torn block. The Redis tests start `redis-server` on a loopback port.
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import hf_kvplus.paging.folder_blocks as folder_blocks
from conformance.models import get_model
from hf_kvplus import BlockServerError, DiskTierError, PagedCache, PagedPool, cache_kwargs
from hf_kvplus.paging import FolderBlocks, RedisBlocks, chain_hashes
from hf_kvplus.paging.block_record import decode_record, encode_record

BLOCK = 8


def prompt(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


class Recording:
    """A back end that records the keys asked for and written."""

    def __init__(self, inner):
        self.inner, self.asked, self.written = inner, [], []

    def get(self, key):
        self.asked.append(key)
        return self.inner.get(key)

    def put(self, items):
        self.written += [k for k, _ in items]
        self.inner.put(items)

    def touch(self, keys):
        self.inner.touch(keys)

    def discard(self, key):
        self.inner.discard(key)


def store_prompt(model, backend, ids, namespace="tenant-a", window=None, **pool_kwargs) -> PagedPool:
    pool = PagedPool(model.config, prefix_backend=backend, **{"block_size": BLOCK, **pool_kwargs})
    cache = PagedCache(config=model.config, pool=pool, namespace=namespace, **({} if window is None else {"window": window}))
    assert cache.reuse_prefix(ids) == 0
    with torch.no_grad():
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=1, do_sample=False)
    cache.store_prefix(ids)
    return pool


def reuse_and_generate(model, backend, ids, namespace="tenant-a", window=None, **pool_kwargs):
    pool = PagedPool(model.config, prefix_backend=backend, **{"block_size": BLOCK, **pool_kwargs})
    cache = PagedCache(config=model.config, pool=pool, namespace=namespace, **({} if window is None else {"window": window}))
    reused = cache.reuse_prefix(ids)
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    return reused, out, pool


def test_a_new_pool_on_the_folder_reuses_the_stored_prefix_and_gives_the_same_tokens(tmp_path):
    model, ids = get_model("llama"), prompt(30, seed=1)
    store_prompt(model, tmp_path, ids)
    reused, out, pool = reuse_and_generate(model, tmp_path, ids)
    assert reused == 24 and pool.prefix_store.stats.tier_hit_blocks == 3
    with torch.no_grad():
        fresh = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, fresh)


def test_quantized_blocks_stay_quantized_on_the_back_end(tmp_path):
    model, ids = get_model("llama"), prompt(48, seed=2)
    pool = store_prompt(model, tmp_path, ids, window=16, bits=4, block_size=16)
    files = sorted(tmp_path.glob("*/*/*.kvb"))
    layer = pool.layers[0]
    assert len(files) == pool.prefix_store.stats.inserted_blocks == 2  # 48 tokens less the window: blocks of 16
    key = f"{files[0].parent.parent.name}/{files[0].stem}"
    tensors = decode_record(files[0].read_bytes(), key)
    assert {name: t.dtype for lay, name, t in tensors if lay == 0} == {n: t.dtype for n, t in layer.tensors().items()}
    assert tensors[0][2].dtype == torch.uint8
    payload = sum(t.numel() * t.element_size() for _, _, t in tensors)
    assert payload == sum(pool.layers[i].block_bytes for i in pool.layers)
    reused, _, again = reuse_and_generate(model, tmp_path, ids, window=16, bits=4, block_size=16)
    assert reused == 32 and again.prefix_store.stats.tier_hit_blocks == 2  # (the window's 16 tokens are prefilled)


def test_a_tenant_never_asks_for_another_tenants_blocks_in_the_folder(tmp_path):
    model, ids = get_model("llama"), prompt(30, seed=3)
    writer = Recording(FolderBlocks(tmp_path))
    store_prompt(model, writer, ids, namespace="tenant-a")
    reader = Recording(FolderBlocks(tmp_path))
    reused, _, _ = reuse_and_generate(model, reader, ids, namespace="tenant-b")
    assert reused == 0 and reader.asked and not set(reader.asked) & set(writer.written)
    assert reuse_and_generate(model, FolderBlocks(tmp_path), ids, namespace="tenant-a")[0] == 24


def test_a_damaged_block_is_refused_dropped_and_recomputed(tmp_path):
    model, ids = get_model("llama"), prompt(30, seed=4)
    store_prompt(model, tmp_path, ids)
    third = chain_hashes(ids[0].tolist(), "tenant-a", BLOCK)[2].hex()
    (damaged,) = tmp_path.glob(f"*/*/{third}.kvb")
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    reused, out, pool = reuse_and_generate(model, tmp_path, ids)
    assert reused == 16 and pool.prefix_store.tier.stats.refused_blocks == 1 and not damaged.exists()
    with torch.no_grad():
        fresh = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, fresh)


def test_the_folder_stays_within_its_bytes_least_recently_used_first(tmp_path):
    key = "scope/" + "ab" * 16
    record = encode_record(key, [(0, "k", torch.ones(2, 8, 4))])
    folder = FolderBlocks(tmp_path, max_bytes=3 * len(record))
    keys = [f"scope/{i:032x}" for i in range(5)]
    for k in keys[:3]:
        folder.put([(k, encode_record(k, [(0, "k", torch.ones(2, 8, 4))]))])
        time.sleep(0.01)
    folder.touch([keys[0]])  # now the most recent
    for k in keys[3:]:
        time.sleep(0.01)
        folder.put([(k, encode_record(k, [(0, "k", torch.ones(2, 8, 4))]))])
    assert folder.nbytes() <= 3 * len(record)
    assert [k for k in keys if folder.get(k) is not None] == [keys[0], keys[3], keys[4]]


def test_a_full_folder_is_a_disk_tier_error_and_keeps_whole_blocks(tmp_path, monkeypatch):
    model, ids = get_model("llama"), prompt(30, seed=8)
    writes = []

    def full(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            writes.append(file)
            if len(writes) >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(folder_blocks, "open", full, raising=False)
    with pytest.raises(DiskTierError, match=r"could not write the \d+ bytes of block \w+/\w+ to .*No space left on "
                                            r"device.*; \d+ bytes are free there"):  # fmt: skip
        store_prompt(model, tmp_path, ids)
    monkeypatch.undo()
    assert len(list(tmp_path.glob("*/*/*.kvb"))) == 1 and not list(tmp_path.glob("*/*/.tmp-*"))
    reused, out, pool = reuse_and_generate(model, tmp_path, ids)  # the block written whole is read back
    assert reused == BLOCK and pool.prefix_store.tier.stats.refused_blocks == 0
    with torch.no_grad():
        fresh = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, fresh)


WRITER = """
import sys, torch
sys.path.insert(0, {src!r})
from hf_kvplus.paging import FolderBlocks
from hf_kvplus.paging.block_record import encode_record, decode_record
folder, me = FolderBlocks({root!r}, max_bytes={max_bytes}), {me}
keys = [f"scope/{{i:032x}}" for i in range(6)]
reads = torn = foreign = 0
for step in range({steps}):
    key = keys[step % len(keys)]
    folder.put([(key, encode_record(key, [(0, "k", torch.full((64, 64), float(me * 1000 + step)))]))])
    for other in keys:
        data = folder.get(other)
        if data is not None:
            t = decode_record(data, other)[0][2]
            reads += 1
            torn += int(not bool((t == t.flatten()[0]).all()))
            foreign += int(int(t.flatten()[0]) % 1000 % len(keys) != keys.index(other))  # written under another key
print(reads, torn, foreign)
"""


def test_processes_writing_and_reading_one_folder_never_read_a_torn_block(tmp_path):
    """Three processes write the same six keys and read all of them after every write, under a bound that removes
    files as they go: every block read passes its checksum and key check (`decode_record`), holds one writer's one
    write whole, and is one that was written under the key read."""
    src = str(Path(__file__).parent.parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER.format(src=src, root=str(tmp_path), max_bytes=4 * 64 * 64 * 4, me=me, steps=60)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for me in range(3)
    ]  # fmt: skip
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err  # decode_record raises CorruptFileError on any torn or damaged read
        reads, torn, foreign = map(int, out.split())
        assert reads > 60 and torn == 0 and foreign == 0


SHARER = """
import sys, torch
sys.path.insert(0, {tests!r})
from conformance.models import get_model
from hf_kvplus import PagedCache, PagedPool, cache_kwargs
model = get_model("llama")
ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7))
pool = PagedPool(model.config, block_size=8, prefix_backend={root!r})
reused = []
for _ in range(3):
    cache = PagedCache(config=model.config, pool=pool, namespace="doc")
    reused.append(cache.reuse_prefix(ids))
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=4, do_sample=False)
    cache.store_prefix(ids)
    pool.prefix_store.clear()  # the next round reads the folder again, as a new process would
print(",".join(map(str, reused)), pool.prefix_store.tier.stats.refused_blocks, ",".join(map(str, out[0, 40:].tolist())))
"""


def test_processes_sharing_one_prompt_through_the_folder_reuse_it_and_agree(tmp_path):
    code = SHARER.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    lines = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        lines.append(out.split())
    model, ids = get_model("llama"), prompt(40, seed=7)
    with torch.no_grad():
        fresh = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=4, do_sample=False)
    for reused, refused, tokens in lines:
        assert reused.split(",")[1:] == ["32", "32"] and refused == "0"
        assert tokens == ",".join(map(str, fresh[0, 40:].tolist()))


# ------------------------------------------------------------------ Redis / Valkey


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Failing:
    """A back end whose reads fail from the `k`-th on (counted from 1)."""

    def __init__(self, inner, k):
        self.inner, self.k, self.reads = inner, k, 0

    def get(self, key):
        self.reads += 1
        if self.reads >= self.k:
            raise BlockServerError(f"could not read block {key}")
        return self.inner.get(key)

    def put(self, items):
        self.inner.put(items)

    def touch(self, keys):
        self.inner.touch(keys)

    def discard(self, key):
        self.inner.discard(key)


def test_a_back_end_that_fails_mid_lookup_leaves_no_reference_behind(tmp_path):
    model, ids = get_model("llama"), prompt(30, seed=9)
    store_prompt(model, tmp_path, ids)
    pool = PagedPool(model.config, block_size=BLOCK, prefix_backend=Failing(FolderBlocks(tmp_path), k=3))
    with pytest.raises(BlockServerError, match="could not read block"):
        pool.prefix_store.lookup(ids[0].tolist(), "tenant-a")
    pool.prefix_store.check()  # the two blocks read are stored, each with the store's reference only
    assert len(pool.prefix_store) == 2
    assert all(pool.blocks["full"].refcount(e.block_id) == 1 for e in pool.prefix_store._entries.values())


def test_a_server_that_cannot_be_reached_is_a_typed_error_naming_it():
    pytest.importorskip("redis", reason="the redis client is not installed (pip install 'hf-kvplus[redis]')")
    url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    blocks = RedisBlocks(url, prefix="gone:")
    with pytest.raises(BlockServerError, match=rf"could not read block gone:scope/ab from {url}"):
        blocks.get("scope/ab")
    with pytest.raises(BlockServerError, match=rf"could not write 2 blocks \(7 bytes, the first gone:scope/ab\) to {url}"):
        blocks.put([("scope/ab", b"abc"), ("scope/cd", b"defg")])


@pytest.fixture(scope="module")
def redis_url():
    pytest.importorskip("redis", reason="the redis client is not installed (pip install 'hf-kvplus[redis]')")
    server = shutil.which("redis-server") or shutil.which("valkey-server")
    if server is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "redis-server"], capture_output=True, timeout=300)
        server = shutil.which("redis-server")
    if server is None:
        pytest.skip("no redis-server or valkey-server, and apt-get could not install redis-server here")
    port = _free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.network
def test_a_new_pool_on_redis_reuses_the_stored_prefix_and_gives_the_same_tokens(redis_url):
    model, ids = get_model("llama"), prompt(30, seed=5)
    store_prompt(model, RedisBlocks(redis_url, prefix="same:"), ids)
    reused, out, pool = reuse_and_generate(model, RedisBlocks(redis_url, prefix="same:"), ids)
    assert reused == 24 and pool.prefix_store.stats.tier_hit_blocks == 3
    with torch.no_grad():
        fresh = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, fresh)


@pytest.mark.network
def test_a_tenant_never_asks_for_another_tenants_blocks_in_redis(redis_url):
    model, ids = get_model("llama"), prompt(30, seed=6)
    writer = Recording(RedisBlocks(redis_url, prefix="tenants:"))
    store_prompt(model, writer, ids, namespace="tenant-a")
    reader = Recording(RedisBlocks(redis_url, prefix="tenants:"))
    reused, _, _ = reuse_and_generate(model, reader, ids, namespace="tenant-b")
    assert reused == 0 and reader.asked and not set(reader.asked) & set(writer.written)
    assert reuse_and_generate(model, RedisBlocks(redis_url, prefix="tenants:"), ids, namespace="tenant-a")[0] == 24
