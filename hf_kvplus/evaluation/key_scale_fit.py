"""Fitting a model's key scale (`key_scale.KeyScale`) on a text: one cache-free forward, the queries and keys taken
before RoPE (after QK-norm where the model has it, else the projections' outputs), and per layer, KV head and RoPE
pair (channels p and p + D/2) ``s = sqrt(rms(q) / rms(k))``, normalized so that the keys' mean square stays the same.

Why that s: a rotated format's coding error is about isotropic, its variance proportional to the coded key's squared
length, so a logit's error variance goes as ``(sum_p rms(q_p)**2 / s_p**2) (sum_p rms(k_p)**2 s_p**2)``, least at
``s_p**2 = rms(q_p) / rms(k_p)`` (Cauchy-Schwarz). Full-attention layers' keys are measured less their mean (the
turning centre codes them less their pre-RoPE mean), sliding layers' as they are (their fixed centre goes stale).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from ..key_scale import KeyScale
from ..model_spec import ModelSpec


def pair_rms(x: torch.Tensor) -> torch.Tensor:
    """[H, N, D] -> [H, D/2]: the RMS of each rotate-half pair (channels p and p + D/2) over N."""
    half = x.shape[-1] // 2
    return ((x[..., :half] ** 2 + x[..., half:] ** 2) / 2).mean(1).sqrt()


def queries_and_keys(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer index, (queries [KV heads, N, D]: each KV head's query heads pooled over tokens, keys [KV heads, T,
    D]) before RoPE, of one cache-free forward of `ids` [T]."""
    held, hooks, d = {}, [], model.config.head_dim
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise UnsupportedModelError(f"{type(model).__name__}: a key scale is fitted on model.model.layers[i].self_attn")

    def keep(index, side):
        def hook(_module, _inputs, out):
            out = out if out.ndim == 4 else out.view(*out.shape[:2], -1, d).transpose(1, 2)  # a projection's
            held.setdefault(index, {})[side] = out[0].float()

        return hook

    for index, layer in enumerate(layers):
        attention = layer.self_attn
        normed = hasattr(attention, "q_norm") and hasattr(attention, "k_norm")
        sides = (attention.q_norm, attention.k_norm) if normed else (attention.q_proj, attention.k_proj)
        hooks += [module.register_forward_hook(keep(index, side)) for side, module in zip("qk", sides, strict=True)]
    forward_with(model, ids, hooks)
    return {i: (h["q"].reshape(h["k"].shape[0], -1, d), h["k"]) for i, h in held.items()}


def forward_with(model, ids: torch.Tensor, hooks: list) -> None:
    """One cache-free forward of `ids` [T] with `hooks` registered (removed after it, whatever happens)."""
    try:
        with torch.inference_mode():
            model(input_ids=ids[None], use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()


def fit_key_scale(model, ids: torch.Tensor, name: str, measured: dict | None = None) -> KeyScale:
    """The key scale of `model` (called `name`) fitted on the token ids `ids` [T]. Pairs exactly zero in the queries
    or keys (a QK-norm weight of -1) get a floor on their RMS: their scale is then tiny or large, and the zero side
    stays zero, so the logits stay the same."""
    spec = ModelSpec.from_config(model.config)
    scales = {}
    for index, (q, k) in queries_and_keys(model, ids).items():
        if not spec.layers[index].holds_kv:
            continue
        rq = pair_rms(q)
        rk = pair_rms(k - k.mean(dim=1, keepdim=True) if spec.layers[index].kind == "full" else k)
        rq, rk = rq.clamp_min(1e-6 * float(rq.max())), rk.clamp_min(1e-6 * float(rk.max()))
        s = (rq / rk).sqrt()
        s = s / ((rk**2 * s**2).sum(-1, keepdim=True) / (rk**2).sum(-1, keepdim=True)).sqrt()
        scales[index] = torch.cat([s, s], dim=-1)
    return KeyScale(name, getattr(model.config, "model_type", ""), spec.num_layers, scales,
                    {"tokens": int(ids.numel()), **(measured or {})})  # fmt: skip
