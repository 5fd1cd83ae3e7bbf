"""A forward's queries attend to their window at full precision: the `window` newest tokens of each query's own
position, so a chunk of `new` tokens sees the newest `window + new - 1` exact, the past's window included, though
the chunk pushes those tokens out of the window and they are quantized as it returns. A one-token step sees the
`window` newest, as before. Checked on what `update` hands attention, for every storage a quantized cache uses."""

from __future__ import annotations

import pytest
import torch

from conformance.models import get_model
from hf_kvplus.attention.route import KV_READ_ATTR
from hf_kvplus.specs import parse_cache_spec

WINDOW = 8
SPECS = [
    f"quantized:int4:group=4:window={WINDOW}",
    f"quantized:int4:group=4:window={WINDOW}:backend=quanto",
    f"quantized:k4v2:window={WINDOW}",
    f"paged-quantized:int4:group=4:window={WINDOW}:block=8",
    f"quantized:int4:group=4:window={WINDOW}:max_tokens=96",
    f"offloaded-quantized:int4:group=4:window={WINDOW}",
]


def attended(cache, keys, values):
    """The keys and values attention receives from layer 0 for this forward's `keys`/`values`, as dense tensors
    of the held tokens in order (a static storage's trailing ring part cut off)."""
    k, v = cache.update(keys, values, 0)
    read = getattr(k, KV_READ_ATTR, None)
    query = torch.randn(keys.shape[0], keys.shape[1], keys.shape[2], keys.shape[3])
    cache.layers[0].attend(None, query, k, v, None, 1.0)  # (the layer expects its attention before the next update)
    if read is not None:  # blocks or codes read in place: the tokens they hold, as attention gathers them
        k, v = read.dense()
    seen = cache.get_seq_length(0)
    return k[:, :, :seen], v[:, :, :seen]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(("prompt", "chunk"), [(40, 24), (40, 5), (21, 16)])
def test_a_chunk_attends_to_the_past_window_at_full_precision(spec, prompt, chunk):
    if spec.endswith("backend=quanto"):
        pytest.importorskip("optimum.quanto")
    config = get_model("llama").config
    cache = parse_cache_spec(spec).build(config)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    all_k = torch.randn(2, heads, prompt + chunk + 1, dim)
    all_v = torch.randn(2, heads, prompt + chunk + 1, dim)
    all_k[..., 3] *= 20  # an outlier channel: quantization error shows
    attended(cache, all_k[:, :, :prompt], all_v[:, :, :prompt])
    k, v = attended(cache, all_k[:, :, prompt : prompt + chunk], all_v[:, :, prompt : prompt + chunk])
    end = prompt + chunk
    exact = WINDOW + chunk - 1
    assert torch.equal(k[:, :, end - exact :], all_k[:, :, end - exact : end]), "a query's window was quantized"
    assert torch.equal(v[:, :, end - exact :], all_v[:, :, end - exact : end])
    coded = k[:, :, : end - exact - 4]  # what every query's window has passed (a group may stay exact after it)
    assert not torch.equal(coded, all_k[:, :, : coded.shape[2]]), "nothing older was quantized: the test shows nothing"
    # A one-token step after it sees its own window exact, the `window` newest.
    k, _ = attended(cache, all_k[:, :, end : end + 1], all_v[:, :, end : end + 1])
    assert torch.equal(k[:, :, end + 1 - WINDOW : end + 1], all_k[:, :, end + 1 - WINDOW : end + 1])
