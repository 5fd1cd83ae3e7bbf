"""A tiny Llama with a word-level tokenizer trained on a given text, saved as a local model folder: what the
`kvplus` commands load with `--model <folder>` (and `--text <file>`) in tests."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def save_word_model(folder: Path, vocabulary: str, **config) -> PreTrainedTokenizerFast:
    """Writes the tokenizer (every word of `vocabulary`) and a random 2-layer Llama (`config` overrides) to
    `folder`; returns the tokenizer."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([vocabulary], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    options = dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)  # fmt: skip
    LlamaForCausalLM(LlamaConfig(**{**options, **config})).save_pretrained(folder)
    return fast


def local_model(tmp_path_factory, text: str) -> tuple[str, str]:
    """The word model of `text` in a folder and `text` in a file, for a module-scoped fixture: (model folder, text
    file), as `--model` and `--text` take them."""
    folder = tmp_path_factory.mktemp("model")
    save_word_model(folder, text)
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(text)
    return str(folder), str(path)
