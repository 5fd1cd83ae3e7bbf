"""A key centre that turns with the position as RoPE turns the keys: the keys' pre-RoPE mean, at each key's position.

Why (KVQuant's pre-RoPE keys, kept post-RoPE): a layer's keys share a large per-channel mean before RoPE
(the same channels are large in every token). RoPE turns each channel pair by an angle proportional to the
position, so after it the mean over positions keeps only the slowly turning pairs: on SmolLM2-135M (Persuasion,
2,048 tokens, mean over layers) a fixed post-RoPE centre leaves 47% of the keys' energy to code, the pre-RoPE mean
turned to each key's position 23%. Coded relative to it, the same codes cost about a quarter less divergence from
the full-precision model (BENCHMARKS.md, "turning key centre").

The centre at position p is linear in a position basis shared by every head and layer of a model,
``e(p) = [cos(p theta_i) (i < h), sin(p theta_i) (i < h), 1 (channels past the rotary dims)]`` (h = half the rotary
dims): ``c(p) = e(p) @ W`` with W [D, D] made from the pre-RoPE mean ``mu`` (:meth:`RotaryBasis.weights`, RoPE in
the rotate-half convention). So attention adds ``q . c(p) = e(p) . (W q)``: the query's weights once per step, then
a dot product with the basis row of each key's position; in a rotated format's space ``c(p) @ R = e(p) @ (W R)``.
Any centre decodes what was coded with it, so a key whose RoPE position differs from its index (a left-padded
row) is still decoded exactly as coded; it is only coded relative to a centre turned a little off.
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels.errors import ConfigError, ShapeError

__all__ = ["TURN_BLOCK", "PositionTables", "RotaryBasis"]

#: Codes per block of a turning key centre's term in the C++ decode operator (its `kTurnBlock`): `block_basis`.
TURN_BLOCK = 64


class RotaryBasis:
    """The position basis of a model's rotary embedding: its inverse frequencies (float64, ``rotary_dim / 2`` of
    them, the pairs ``i, i + rotary_dim / 2``) and head dim; channels past ``rotary_dim`` do not turn."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int):
        self.inv_freq = inv_freq.detach().double().cpu()
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.head_dim = head_dim
        if self.rotary_dim > head_dim or self.rotary_dim == 0:
            raise ConfigError(f"{self.rotary_dim} rotary dims do not fit head_dim {head_dim}")
        self._tables: dict[int, PositionTables] = {}

    def tables(self, origin: int) -> PositionTables:
        """The position tables of index 0 at position `origin`: one object per basis and origin, so that every layer
        of a cache (one basis per cache) reads, and memory holds, one copy."""
        tables = self._tables.get(origin)
        if tables is None:
            tables = self._tables.setdefault(origin, PositionTables(self, origin))
        return tables

    def derived_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of every origin's position tables (derived from the basis alone: not saved, not bytes at
        rest; what a report of a cache's derived tables counts, once)."""
        return tuple(t for tables in self._tables.values() for t in tables.tensors())

    def __getstate__(self) -> dict:
        """Without the position tables: they are derived from the basis, so a saved or copied basis makes them again
        (the first call that asks for them, or a layer's `prepare`)."""
        return {**self.__dict__, "_tables": {}, "_inv_freq_on": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_tables", {})
        self.__dict__.setdefault("_inv_freq_on", {})

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., D]``: ``e(p)`` of each position (angles in float64)."""
        angles = positions.to(torch.float64)[..., None] * self._frequencies_on(positions.device)
        rest = torch.ones(*positions.shape, self.head_dim - self.rotary_dim, dtype=torch.float64, device=positions.device)
        return torch.cat((angles.cos(), angles.sin(), rest), dim=-1).float()

    def _frequencies_on(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies on `device`, copied there once (eagerly: the first tables are made where a storage
        prepares): a copy from host memory at every decode step's `rows` is a synchronizing call on CUDA."""
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            inv_freq = self.inv_freq.to(device, non_blocking=True)  # queued, not waited on (the source is kept)
            if not torch.compiler.is_compiling():
                self._inv_freq_on[device] = inv_freq
        return inv_freq

    def weights(self, mu: torch.Tensor) -> torch.Tensor:
        """float32 [H, D, D]: W of each head's pre-RoPE mean ``mu`` [H, D], ``c(p) = e(p) @ W`` = mu turned to p."""
        H, D = self._checked(mu, "mu")
        h, r = self.rotary_dim // 2, self.rotary_dim
        i = torch.arange(h, device=mu.device)
        mu = mu.float()
        w = torch.zeros(H, D, D, device=mu.device)
        w[:, i, i] = mu[:, :h]  # c_i = mu_i cos - mu_{i+h} sin
        w[:, h + i, i] = -mu[:, h:r]
        w[:, i, h + i] = mu[:, h:r]  # c_{i+h} = mu_{i+h} cos + mu_i sin
        w[:, h + i, h + i] = mu[:, :h]
        rest = torch.arange(r, D, device=mu.device)
        w[:, rest, rest] = mu[:, r:]
        return w

    def unturned(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """float32 x [B, H, T, D], each token turned at its position (`positions` [T], or [B, H, T] per row and head),
        turned back to position 0: the keys before RoPE (negative positions turn them on)."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim or positions.shape not in (x.shape[2:3], x.shape[:3]):
            raise ShapeError(f"expected x [B, H, T, {self.head_dim}] and positions [T] or [B, H, T], got "
                             f"{tuple(x.shape)} and {tuple(positions.shape)}")  # fmt: skip
        h, r = self.rotary_dim // 2, self.rotary_dim
        e = self.rows(positions)
        cos, sin = e[..., :h], e[..., h:r]
        x = x.float()
        x1, x2 = x[..., :h], x[..., h:r]
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin, x[..., r:]), dim=-1)

    def _checked(self, mu: torch.Tensor, name: str) -> tuple[int, int]:
        if mu.dim() != 2 or mu.shape[-1] != self.head_dim:
            raise ShapeError(f"{name} must be [H, {self.head_dim}], got {tuple(mu.shape)}")
        return mu.shape[0], mu.shape[1]


class PositionTables:
    """What decode reads of the basis at indices ``0, 1, ...`` from position `origin`, made once and shared by every
    layer whose key centre turns with that basis from that origin (`RotaryBasis.tables`).

    Why shared: the tables depend only on the model's RoPE and the origin, not on a layer's keys; held per layer they
    cost D float32 a position each time (head dim 128 at 32K positions on CUDA: 16 MiB a layer, 0.5 GiB over Llama
    3.1 8B's 32 layers). Each is made where a storage prepares (eagerly), grown by doubling on a host-side length
    check (no device sync), and never kept when made inside a compiled graph (that graph's value, not a tensor to
    keep). Replacing a kept table is one attribute
    store, so layers that read them from several threads see an old table or a new one, both right."""

    __slots__ = ("turns", "origin", "_basis", "_block", "_steps")

    def __init__(self, turns: RotaryBasis, origin: int):
        self.turns, self.origin = turns, origin
        self._basis: torch.Tensor | None = None  # e(origin + i) of indices 0 .. len - 1 as columns, grown by doubling
        self._block: tuple | None = None  # (start, size, device, block_basis's first columns) of the last call
        self._steps: tuple | None = None  # (size, block_basis's angles), grown by doubling

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tables kept (derived: a memory report counts them once per cache, apart from bytes at rest)."""
        kept = (self._basis, None if self._block is None else self._block[3], None if self._steps is None else self._steps[1])
        return tuple(t for t in kept if t is not None)

    def basis(self, count: int, device: torch.device) -> torch.Tensor:
        """float32 [D, count]: the basis ``e(origin + i)`` of indices 0 .. count - 1 as columns, unit stride along the
        indices (a view of a table kept on `device` and doubled when a longer one is asked for: a host-side length
        check, no device sync)."""
        table = self._basis
        if table is None or table.shape[1] < count or table.device != torch.device(device):
            size = max(1 << (count - 1).bit_length(), 256)
            table = self.turns.rows(torch.arange(self.origin, self.origin + size, device=device)).T.contiguous()
            if not torch.compiler.is_compiling():
                self._basis = table
        return table[:, :count]

    def prepare(self, count: int, device: torch.device) -> None:
        """Makes and keeps, eagerly, what a decode over indices 0 .. count - 1 reads on `device` (a compiled step that
        made it would make it at every step): `basis` on CUDA (the Triton kernels), `block_basis` elsewhere (the C++
        operator)."""
        if torch.device(device).type == "cuda":
            self.basis(count, device)
        else:
            self.block_basis(0, count, device)

    def block_basis(
        self, start: int, count: int, device: torch.device, size: int = TURN_BLOCK
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the C++ decode reads over indices ``start .. start + count``, in blocks of `size`: float32 [D, size],
        the basis ``e(origin + start + j)`` of j < size as columns, and float32 [K, 2, h] (K >= count / size blocks, h
        rotary pairs), the cos and the sin of each pair's angle at position ``size * k``. RoPE's angles add, so block
        k's basis is the first block's turned by those angles: a few KB, where `basis` holds D floats a position.
        Both kept (the angles grown by doubling), so a decode step computes neither."""
        dev, blocks = torch.device(device), -(-count // size)
        first = self._block
        if first is None or first[:3] != (start, size, dev):
            first = (start, size, dev, self.turns.rows(torch.arange(size, device=dev) + self.origin + start).T.contiguous())
            if not torch.compiler.is_compiling():
                self._block = first
        steps = self._steps
        if steps is None or steps[0] != size or steps[1].shape[0] < blocks or steps[1].device != dev:
            h = self.turns.rotary_dim // 2
            rows = self.turns.rows(size * torch.arange(max(1 << (blocks - 1).bit_length(), 64), device=dev))
            steps = (size, rows[:, : 2 * h].reshape(-1, 2, h).contiguous())
            if not torch.compiler.is_compiling():
                self._steps = steps
        return first[3], steps[1]
