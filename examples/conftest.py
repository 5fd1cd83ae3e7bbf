"""The examples' tests: the example files import by name, as a user's own files would, and share a tiny model."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def model():
    """A random 2-layer Llama (4 query heads, 2 KV heads), on sdpa attention (the default)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    return LlamaForCausalLM(config).eval()
