"""The codes and decode outputs of every built-in format, bit for bit, as the implementation before formats became
plug-ins made them: a refactoring of the format code must not move one bit (digests of fixed inputs, recorded on
the CPU with the C++ operators built; the twins' own digests too)."""

import hashlib

import pytest
import torch

from conformance.models import get_model
from hf_kvplus import QuantizedCache
from hf_kvplus.kernels import dispatch, quant_format, rotated_cpu
from hf_kvplus.kernels.quant_attention import quantized_decode_attention_torch
from hf_kvplus.kernels.quant_format import PackedKV, QuantFormat
from hf_kvplus.kernels.rotated_format import RotatedFormat

pytestmark = pytest.mark.usefixtures("on_cpu")


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def inputs(seed=7, B=2, H=2, T=64, D=64):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, H, T, D, generator=g) + torch.linspace(-2, 3, D)).to(torch.float16)
    v = torch.randn(B, H, T, D, generator=g).to(torch.float16)
    q = torch.randn(B, 2 * H, D, generator=g).to(torch.float16)
    ring = torch.randn(2, B, H, 5, D, generator=g).to(torch.float16)
    return q, k, v, ring


def layer(fmt, index):
    """Layer `index`'s format and its state, as a cache's layer holds them."""
    return fmt.for_layer(index), fmt.make_state()


#: name: (format, the layer's state)
FORMATS = {
    "int8": lambda: (QuantFormat(8, 32), None),
    "int4": lambda: (QuantFormat(4, 32), None),
    "int2": lambda: (QuantFormat(2, 32), None),
    "fp8": lambda: (QuantFormat("fp8", 32), None),
    "k4v2-centred": lambda: layer(RotatedFormat(4, 2), 3),
    "k3v2": lambda: (RotatedFormat(3, 2, seed=5), None),
}

#: name: (twin codes, dispatched codes, twin decode output, dispatched decode output)
EXPECTED = {
    "int8": ("47d281ff6253985b", "47d281ff6253985b", "700dd0b9f3783fc5", "1b121eb9a415b5b4"),
    "int4": ("fdcb06c632fd3cae", "fdcb06c632fd3cae", {"cdbe65fab5ae690b", "473924716dedf4f0"}, "cdbe65fab5ae690b"),
    "int2": ("1185caf09335f061", "1185caf09335f061", "9dda7171e5bf07dc", "e124191b93579f1e"),
    "fp8": ("6917867a1f2d198d", "6917867a1f2d198d", "37ce65c685de4a02", "37ce65c685de4a02"),
    "k4v2-centred": ("567ec5ffb7a29c94", "567ec5ffb7a29c94", "8d34693b623a578e", "f7c64c17f7697595"),
    "k3v2": ("fb338c2493dbf651", "fb338c2493dbf651", "4a782503d29dd9a0", {"4e2e4ab782902215", "02a352cddb81f815"}),
}
#: A set of digests: an output as recorded on each CPU it ran on, where the vector width sets the order of its sums:
#: the C++ operator is built with -march=native (k3v2's decode output moves in its last bits between the CPU it was
#: first recorded on and an AMD EPYC with AVX2 and FMA, no AVX-512), and torch's own CPU kernels pick their vector
#: width at run time (int4's twin decode output moves on an AMD EPYC with AVX-512).


def codes_and_outputs(name):
    q, k, v, ring = inputs()
    fmt, state = FORMATS[name]()
    twin = (*quant_format.quantize_keys(k, fmt, state=state), *quant_format.quantize_values(v, fmt))
    fmt, state = FORMATS[name]()
    kc, ks, kz = dispatch.quantize_keys(k, fmt, check=False, state=state)
    vc, vs, vz = dispatch.quantize_values(v, fmt, check=False)
    packed = PackedKV(kc, ks, kz, vc, vs, vz)
    kw = dict(start=3, length=61, scale=0.125, residual_k=ring[0], residual_v=ring[1], state=state)
    twin_out = quantized_decode_attention_torch(q, packed, fmt, **kw, check=False)
    out = dispatch.quantized_decode_attention(q, packed, fmt, **kw, check=False)
    return digest(*twin), digest(kc, ks, kz, vc, vs, vz), digest(twin_out), digest(out)


@pytest.mark.skipif(not rotated_cpu.available(), reason="the digests were recorded with the C++ operators built")
@pytest.mark.parametrize("name", list(FORMATS))
def test_codes_and_decode_outputs_are_the_recorded_ones(name):
    got = codes_and_outputs(name)
    assert [d if isinstance(e, str) or d not in e else e for d, e in zip(got, EXPECTED[name], strict=True)] == list(
        EXPECTED[name])


GREEDY = {
    "int4": [18, 36, 112, 28, 93, 4, 93, 4, 113, 106, 102, 87, 83, 70, 68, 82, 91, 42, 25, 53, 115, 8, 111, 92],
    "k4v2": [18, 36, 107, 92, 43, 100, 43, 125, 31, 106, 66, 24, 15, 11, 87, 125, 125, 121, 62, 68, 55, 23, 25, 10],
}


@pytest.mark.parametrize("bits", ["int4", "k4v2"])
def test_greedy_tokens_of_a_quantized_cache_are_the_recorded_ones(bits):
    model = get_model("llama")
    ids = torch.arange(3, 40).remainder(model.config.vocab_size)[None]
    cache = QuantizedCache(model.config, bits=bits, window=16)
    out = model.generate(ids, cache=cache, max_new_tokens=24, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == GREEDY[bits]
