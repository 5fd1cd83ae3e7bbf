"""What an eviction policy declares as data: its settings (checked the same way by a cache's keywords and a spec
string's options), what its score reads, and the spec name it registers under.

A policy names itself in its class statement (`class KnormPolicy(ScoredPolicy, name="knorm")`); importing the file
registers it, and `policy_class("knorm")` finds it. Nothing under hf_kvplus changes for a new policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

#: When a policy compresses: after every forward, or after multi-token forwards (prompts) only.
COMPRESS = ("always", "prefill")
#: How the attention mass of several queries of a forward combines: summed over them ("sum"), the largest one query
#: gave ("max", each query's summed over its KV head's query group), or the largest one query head gave ("max_head").
REDUCES = ("sum", "max", "max_head")
#: How a forward's mass joins what the slots already scored: added (accumulated), the larger kept, or replacing it.
JOINS = ("add", "max", "replace")


@dataclass(frozen=True)
class Setting:
    """One option of a policy (or of the cache that runs it): its keyword `name`, `type` (int, float, str or object),
    `default`, bounds (`minimum`, `maximum`) or `choices`, and its key in spec strings (`key`, default `name`)."""

    name: str
    type: type = int
    default: object = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    key: str | None = None

    @property
    def spec_key(self) -> str:
        return self.key or self.name

    def check(self, value, owner: str):
        """`value` as given when it fits (None where the default is None: the policy derives it), else `ConfigError`
        naming the option, the value and what is accepted."""
        if value is None and self.default is None:
            return None
        if self.choices:
            if value not in self.choices:
                raise ConfigError(f"{owner}: {self.name} must be one of {self.choices}, got {self.name}={value!r}")
            return value
        if self.type in (int, float):
            number = isinstance(value, int | float) if self.type is float else isinstance(value, int)
            if isinstance(value, bool) or not number:
                raise ConfigError(f"{owner}: {self.name} must be {'an integer' if self.type is int else 'a number'}, "
                                  f"got {self.name}={value!r}")  # fmt: skip
            if self.minimum is not None and value < self.minimum:
                raise ConfigError(f"{owner}: {self.name} must be >= {self.minimum}, got {self.name}={value}")
            if self.maximum is not None and value > self.maximum:
                raise ConfigError(f"{owner}: {self.name} must be <= {self.maximum}, got {self.name}={value}")
        return value

    def parse(self, text: str, spec: str):
        """The value of spec option `key=text` in spec string `spec`, checked."""
        if self.type in (int, float) and not self.choices:
            try:
                value = self.type(text)
            except ValueError:
                kind = "an integer" if self.type is int else "a number"
                raise ConfigError(f"{self.spec_key} in cache spec {spec!r} must be {kind}, got {text!r}") from None
            if self.minimum is not None and value < self.minimum:
                raise ConfigError(f"{self.spec_key} in cache spec {spec!r} must be >= {self.minimum}, got {value}")
            if self.maximum is not None and value > self.maximum:
                raise ConfigError(f"{self.spec_key} in cache spec {spec!r} must be <= {self.maximum}, got {value}")
            return value
        if self.choices and text not in self.choices:
            raise ConfigError(f"cache spec {spec!r}: {self.spec_key} must be one of {self.choices}, got {text!r}")
        return text


def compress_setting(default: str) -> Setting:
    """The `compress` setting (`COMPRESS`) with its default."""
    return Setting("compress", str, default, choices=COMPRESS)


@dataclass(frozen=True)
class Mass:
    """A score that reads attention mass: of the last `queries` queries of each forward (None: all of them; a str:
    the policy's setting of that name), combined by `reduce` (`REDUCES`) and joined to the slots' scores by `join`
    (`JOINS`); `prompts_only`: one-token steps report none."""

    queries: int | str | None = None
    reduce: str = "sum"
    join: str = "add"
    prompts_only: bool = False

    def __post_init__(self):
        if self.reduce not in REDUCES or self.join not in JOINS:
            raise ConfigError(f"Mass: reduce must be one of {REDUCES} and join one of {JOINS}, got reduce="
                              f"{self.reduce!r}, join={self.join!r}")  # fmt: skip


@dataclass(frozen=True)
class Needs:
    """What a policy's score reads besides the slots' positions: the attention `mass` (a `Mass`, or None), the held
    `keys` (decoded), and with `per_token` a score of each token alone, computed once as it arrives; a
    `reconstruction` pass (KVzip's second forward, run by `kvzip_cache.reconstruct`) or a fitted `surrogate`."""

    mass: Mass | None = None
    keys: bool = False
    per_token: bool = False
    reconstruction: bool = False
    surrogate: bool = False


#: Registered policies by spec name.
POLICIES: dict[str, type] = {}


def register_policy(name: str, cls: type) -> None:
    """Registers `cls` under spec name `name` (a policy's class statement does: `name="..."`)."""
    if not isinstance(name, str) or not name.isidentifier() and not name.replace("-", "_").isidentifier():
        raise ConfigError(f"a policy's spec name is a word such as 'knorm', got {name!r}")
    POLICIES[name] = cls


def policy_class(name: str) -> type:
    """The policy registered under `name`; `ConfigError` naming the registered ones otherwise."""
    if name not in POLICIES:
        raise ConfigError(f"no eviction policy is registered as {name!r}; registered: {sorted(POLICIES)} (a policy "
                          "registers when the file that defines it is imported)")  # fmt: skip
    return POLICIES[name]
