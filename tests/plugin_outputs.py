"""Writes the outputs of Transformers' own caches, with or without hf_kvplus imported, to a file.

Run as a script in a fresh process (`python plugin_outputs.py OUT.pt [--plugin]`): an import cannot be
undone inside one process, so the isolation test compares two processes bit for bit.
"""

import sys

import torch
from transformers import DynamicCache, StaticCache

from conformance.models import PAD_TOKEN_ID, build_model
from hf_kvplus import cache_kwargs

if "--plugin" in sys.argv:
    import hf_kvplus  # noqa: F401

torch.set_num_threads(1)
outputs = {}
prompts = torch.randint(3, 128, (3, 14), generator=torch.Generator().manual_seed(0), device="cpu")
prompts = prompts.to(torch.get_default_device())  # the same ids on every device
mask = torch.ones_like(prompts)
mask[1, :4] = 0  # left padding
mask[2, :9] = 0
prompts = prompts.masked_fill(mask == 0, PAD_TOKEN_ID)
for arch in ["llama", "gemma3"]:
    for attn in ["sdpa", "eager"]:
        model = build_model(arch)
        model.config._attn_implementation = attn
        caches = {
            "default": lambda: None,
            "dynamic": lambda config=model.config: DynamicCache(config=config),
            "static": lambda config=model.config: StaticCache(config=config, max_cache_len=40),
        }
        for name, make in caches.items():
            out = model.generate(
                prompts,
                attention_mask=mask,
                max_new_tokens=10,
                do_sample=False,
                **cache_kwargs(make()),
                return_dict_in_generate=True,
                output_logits=True,
            )
            outputs[f"{arch}-{attn}-{name}-tokens"] = out.sequences
            outputs[f"{arch}-{attn}-{name}-logits"] = torch.stack(out.logits)
        outputs[f"{arch}-{attn}-nocache"] = model(prompts, attention_mask=mask, use_cache=False).logits
torch.save(outputs, sys.argv[1])
