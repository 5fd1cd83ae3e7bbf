"""Stored blocks in a Redis or Valkey server, shared by the machines that reach it (`pip install hf-kvplus[redis]`).

One value per block under `<prefix><key>`; a SET replaces a value whole, so a reader gets a whole record or none,
and records are checked when read (`block_record`). The server bounds the bytes: run it with `maxmemory` and
`maxmemory-policy allkeys-lru` (a GET refreshes a key's recency), as the tests do. A server that cannot be reached or
refuses a command is a `BlockServerError` naming it, the key and the bytes.
"""

from __future__ import annotations

from ..errors import BlockServerError, ConfigError


class RedisBlocks:
    """Stored blocks in the server at `url` (e.g. "redis://127.0.0.1:6379/0"), under keys starting with `prefix`."""

    def __init__(self, url: str, prefix: str = "kvplus:"):
        try:
            import redis
        except ImportError as e:
            raise ConfigError("RedisBlocks needs the redis client: pip install 'hf-kvplus[redis]'") from e
        self.url, self.prefix = url, prefix
        self.client = redis.Redis.from_url(url)
        self._errors = redis.RedisError

    def __repr__(self) -> str:
        return f"RedisBlocks({self.url!r}, prefix={self.prefix!r})"

    def __getstate__(self) -> dict:
        return {"url": self.url, "prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["prefix"])

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get(self.prefix + key)
        except self._errors as e:
            raise BlockServerError(f"could not read block {self.prefix + key} from {self.url}: {e}") from e

    def touch(self, keys: list[str]) -> None:
        """(A GET already refreshed each key's recency.)"""

    def put(self, items: list[tuple[str, bytes]]) -> None:
        if items:
            pipe = self.client.pipeline(transaction=False)
            for key, data in items:
                pipe.set(self.prefix + key, data)
            try:
                pipe.execute()
            except self._errors as e:
                raise BlockServerError(
                    f"could not write {len(items)} blocks ({sum(len(d) for _, d in items)} bytes, the first "
                    f"{self.prefix + items[0][0]}) to {self.url}: {e}"
                ) from e

    def discard(self, key: str) -> None:
        try:
            self.client.delete(self.prefix + key)
        except self._errors as e:
            raise BlockServerError(f"could not remove block {self.prefix + key} from {self.url}: {e}") from e
