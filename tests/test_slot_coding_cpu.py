"""An evicting cache's quantized slots on the CPU code each decode token's key and value with one call, the range
guard folded in (`TokenQuantCodec.guards`, `dispatch.quantize_kv_into`: one operator call for a KIVI format, one per
side for a rotated one), KIVI and rotated formats alike: chosen there, and bit for bit what the guard followed by the
quantize kernel and the copies into the slots gave."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kvplus import cache_kwargs
from hf_kvplus.kernels import rotated_cpu
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage import slot_codecs

SPECS = ["sink:4:40:bits=int4", "h2o:40:bits=int4", "h2o:40:bits=fp8", "sink:4:40:bits=int2", "snapkv:40:bits=int8",
         "sink:4:40:bits=k4v2", "h2o:40:bits=k3v2"]


def model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def decode(net, spec: str, batch: int, steps: int = 12):
    """Logits of a prompt and `steps` greedy steps, and each layer's held keys and values."""
    cache = parse_cache_spec(spec).build(net.config, max_length=128)
    ids = torch.randint(0, 128, (batch, 48), generator=torch.Generator().manual_seed(1))
    logits = []
    for _ in range(steps + 1):
        out = net(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1:]
        logits.append(out)
        ids = out.argmax(-1)
    return torch.cat(logits, 1), [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.skipif(not rotated_cpu.available(), reason="no C++ toolchain: the CPU operators cannot be built")
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("spec", SPECS)
def test_slots_code_decode_tokens_in_one_call_and_equal_the_guarded_kernel(spec, batch, monkeypatch):
    net = model()
    calls = []
    for name in ("quantize_values_into", "quantize_kv_into"):  # (a sink cache recodes its moved sinks' keys alone)
        fused = getattr(slot_codecs, name)
        monkeypatch.setattr(slot_codecs, name, lambda *a, fused=fused, name=name, **k: calls.append((name, k["limit"]))
                            or fused(*a, **k))  # fmt: skip
    got, held = decode(net, spec, batch)
    both = [limit for name, limit in calls if name == "quantize_kv_into"]
    assert len(both) >= 12 * 2, spec  # every decode step, both layers: keys and values in one call
    assert any(limit is not None for limit in both), "the range guard was not folded into the coding"
    monkeypatch.setattr(slot_codecs, "takes_values_into", lambda x, fmt, state=None: False)
    calls.clear()
    want, held_before = decode(net, spec, batch)
    assert not calls
    assert torch.equal(got, want), spec
    for (k, v), (k0, v0) in zip(held, held_before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0), spec
