"""Shifting rotary positions of cached keys, with the model's own rotary parameters.

Keys reach the cache already rotated at their logical position. RoPE makes a score depend only on
the distance between query and key, so moving a cached key by `d` positions is one more rotation
by `d`: no unrotated copy is needed. The inverse frequencies come from the model config through
Transformers' own initialisers (default, linear, dynamic, YaRN, LongRoPE, Llama 3, partial rotary);
the YaRN/LongRoPE attention factor scales cos and sin in the model but is a magnitude, not an
angle, so a shift applies the pure rotation.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..errors import ShapeError, UnsupportedModelError
from ..kernels.turning_center import RotaryBasis
from ..model_spec import ATTENTION_LAYER_KINDS, ModelSpec

#: Model families that rotate interleaved pairs (GPT-J style) rather than the two halves of the head.
INTERLEAVED_ROPE_MODELS = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "chatglm", "deepseek_v2",
                                     "deepseek_v3"})


def _rope_parameters(config: PreTrainedConfig, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]  # per layer type (Gemma 3: full and sliding layers differ)
    return params


class RotaryShift(RotaryBasis):
    """Rotates cached keys by a number of positions, as the model's rotary embedding would (and back to position 0:
    `RotaryBasis.unturned`).

    `rotary_dim` leading channels rotate (the rest pass through, as with partial rotary), in the
    rotate-half convention of Llama-family models: channel i pairs with channel i + rotary_dim / 2.
    """

    def __init__(self, inv_freq: torch.Tensor, head_dim: int):
        if 2 * inv_freq.numel() > head_dim:
            raise UnsupportedModelError(f"rotary dims {2 * inv_freq.numel()} exceed head_dim {head_dim}")
        super().__init__(inv_freq, head_dim)
        self._last: tuple | None = None  # (shift, device, cos, sin) of the last int shift

    @classmethod
    def from_config(cls, config: PreTrainedConfig, layer_type: str | None = "full_attention") -> RotaryShift:
        """The rotation of `config`'s rotary embedding (of `layer_type` where it differs per layer type)."""
        text = config.get_text_config(decoder=True)
        model_type = getattr(text, "model_type", type(text).__name__)
        if model_type in INTERLEAVED_ROPE_MODELS:
            raise UnsupportedModelError(
                f"{model_type} rotates interleaved channel pairs; positions inside the cache support the "
                "rotate-half convention only (use positions='original')"
            )
        params = _rope_parameters(text, layer_type)
        rope_type = params.get("rope_type", params.get("type", "default"))
        kind = ATTENTION_LAYER_KINDS.get(layer_type, "full")
        layers = [layer for layer in ModelSpec.from_config(config).layers if layer.holds_kv]
        dims = sorted({layer.head_dim for layer in layers if layer.kind == kind} or {layer.head_dim for layer in layers})
        if len(dims) != 1:
            raise UnsupportedModelError(
                f"{model_type}: its layers differ in head_dim ({dims}); positions inside the cache rotate keys with "
                "one rotary embedding (use positions='original')"
            )
        head_dim = dims[0]
        if "rope_theta" not in params and getattr(text, "rope_theta", None) is None:
            raise UnsupportedModelError(
                f"{model_type} has no rotary parameters in its config (rope_parameters={params!r}); positions "
                "inside the cache need RoPE (use positions='original')"
            )
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(text, "rope_theta", None))
            factor = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
            dim = int(head_dim * factor)
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        elif rope_type in ROPE_INIT_FUNCTIONS:
            kwargs = {"layer_type": layer_type} if layer_type in (getattr(text, "rope_parameters", None) or {}) else {}
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](text, None, **kwargs)
        else:
            raise UnsupportedModelError(
                f"{model_type} uses rope_type {rope_type!r}; known: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
            )
        return cls(inv_freq, head_dim)

    def rotate(self, keys: torch.Tensor, shift: torch.Tensor | int) -> torch.Tensor:
        """`keys` [batch, heads, n, head_dim] moved `shift` positions later (`shift` [batch], or one int for
        every row).

        Computed in float64 for the angles and float32 for the product, returned in `keys.dtype`. A
        tensor shift stays on the device; an int's factors are kept for the next call (every layer of
        a step asks for the same).
        """
        if keys.ndim != 4 or keys.shape[-1] != self.head_dim:
            raise ShapeError(f"expected keys [batch, heads, n, {self.head_dim}], got {tuple(keys.shape)}")
        if isinstance(shift, torch.Tensor) and shift.shape != keys.shape[:1]:
            raise ShapeError(f"expected one shift per batch row ({keys.shape[0]}), got shape {tuple(shift.shape)}")
        return self.rotate_prepared(self.prepare(keys), shift, keys.dtype)

    def holds(self, keys: torch.Tensor, limit: float) -> torch.Tensor:
        """Which channels of `keys` stay within `limit` in magnitude at every rotation (a bool mask like `keys`): a
        rotary pair's norm bounds both of its rotated channels; the channels past `rotary_dim` do not move."""
        half = self.rotary_dim // 2
        x = keys.float()
        pairs = torch.hypot(x[..., :half], x[..., half : self.rotary_dim]) <= limit
        return torch.cat((pairs, pairs, x[..., self.rotary_dim :].abs() <= limit), dim=-1)

    def prepare(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, their rotate-half partner) in float32: what `rotate_prepared` needs, for keys rotated often."""
        half = self.rotary_dim // 2
        x = keys.float()
        x1, x2, rest = x[..., :half], x[..., half : self.rotary_dim], x[..., self.rotary_dim :]
        return x, torch.cat((-x2, x1, torch.zeros_like(rest)), dim=-1)

    def rotate_prepared(self, prepared: tuple[torch.Tensor, torch.Tensor], shift, dtype: torch.dtype,
                        out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`rotate` of keys already `prepare`d: x * cos + partner * sin; with `out`, written into it in its dtype: eagerly
        by the sum itself (`out=`: two ops, every layer of a sink cache's step), traced by a copy (dynamo refuses `out=`
        for a non-contiguous tensor, and `out` is a view of a buffer)."""
        x, partner = prepared
        cos, sin = self._factors(shift, x.device)
        if out is not None and not torch.compiler.is_compiling():
            return torch.addcmul(x * cos, partner, sin, out=out)
        rotated = torch.addcmul(x * cos, partner, sin)
        return rotated.to(dtype) if out is None else out.copy_(rotated)

    def _factors(self, shift: torch.Tensor | int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the shift's angles over the whole head, `[batch or 1, 1, 1, head_dim]` float32 on
        `device`: each angle twice (both halves), then 1 and 0 on the channels that do not rotate (angle 0)."""
        if isinstance(shift, torch.Tensor):
            angles = shift.to(device, torch.float64)[:, None] * self._wide_freq(device)
            return angles.cos().float()[:, None, None, :], angles.sin().float()[:, None, None, :]
        if self._last is None or self._last[:2] != (shift, device):  # made on the device: no host-to-device copy
            angles = (shift * self._wide_freq(device)).view(1, 1, 1, -1)  # (every layer of a step asks for the same)
            self._last = (shift, device, angles.cos().float(), angles.sin().float())
        return self._last[2], self._last[3]

    def place(self, device: torch.device) -> None:
        """Moves the inverse frequencies to `device` now, eagerly: a compiled step that moved them would hold a CPU
        tensor, which keeps its graph from CUDA graphs."""
        self._wide_freq(device)

    def _wide_freq(self, device: torch.device) -> torch.Tensor:
        """float64 `[head_dim]` on `device`: each inverse frequency twice (both halves), then 0 where channels do not
        rotate, so that a shift's factors are three operations (`_factors`, once per step: every layer asks)."""
        wide = self.__dict__.get("_wide")
        if wide is None or wide.device != device:
            inv = self._frequencies_on(device)
            wide = self._wide = torch.cat((inv, inv, inv.new_zeros(self.head_dim - self.rotary_dim)))
        return wide
