"""Prompts for the CLI: synthetic ones for benchmarks, or one prompt per line of a file."""

import os

import torch

from .errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")


def synthetic_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int):
    """Deterministic random token ids, every prompt exactly prompt_len long (as in FlexGen's and
    H2O's throughput runs, where prompts are padded to the same length)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab_size, (batch, prompt_len), generator=gen)  # ids 0..3 are special in OPT
    return ids, torch.ones_like(ids)


def load_tokenizer(directory: str | None):
    if directory is None or not any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(directory)


def file_prompts(path: str, tokenizer, batch: int, prompt_len: int, pad_token_id: int):
    """Tokenizes one prompt per line and left-pads them to prompt_len."""
    if tokenizer is None:
        raise UsageError("--prompts-file", "needs a tokenizer: give --path (or --model) a directory with "
                         "tokenizer files")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise UsageError("--prompts-file", f"cannot read {path}: {e.strerror}") from None
    if len(lines) != batch:
        raise UsageError("--prompts-file", f"{path} has {len(lines)} prompts; the batch "
                         f"(--gpu-batch-size x --num-gpu-batches) is {batch}")
    ids = torch.full((batch, prompt_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, prompt_len), dtype=torch.long)
    for row, line in enumerate(lines):
        tokens = tokenizer(line)["input_ids"]
        if len(tokens) > prompt_len:
            raise UsageError("--prompts-file", f"prompt {row + 1} has {len(tokens)} tokens, over "
                             f"--prompt-len {prompt_len}")
        if tokens:
            ids[row, -len(tokens):] = torch.tensor(tokens)
            mask[row, -len(tokens):] = 1
    return ids, mask
