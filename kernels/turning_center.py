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

__all__ = ["RotaryBasis"]


class RotaryBasis:
    """The position basis of a model's rotary embedding: its inverse frequencies (float64, ``rotary_dim / 2`` of
    them, the pairs ``i, i + rotary_dim / 2``) and head dim; channels past ``rotary_dim`` do not turn."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int):
        self.inv_freq = inv_freq.detach().double().cpu()
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.head_dim = head_dim
        if self.rotary_dim > head_dim or self.rotary_dim == 0:
            raise ConfigError(f"{self.rotary_dim} rotary dims do not fit head_dim {head_dim}")

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., D]``: ``e(p)`` of each position (angles in float64)."""
        angles = positions.to(torch.float64)[..., None] * self.inv_freq.to(positions.device)
        rest = torch.ones(*positions.shape, self.head_dim - self.rotary_dim, dtype=torch.float64, device=positions.device)
        return torch.cat((angles.cos(), angles.sin(), rest), dim=-1).float()

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
