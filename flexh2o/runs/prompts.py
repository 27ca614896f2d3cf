"""Prompts for the CLI: synthetic ones for benchmarks, or one prompt per line of a file."""

import os

import torch

from flexh2o.common.errors import UsageError, check_regular_file
from flexh2o.engine.preflight import format_size

MAX_PROMPTS_BYTES = 256 << 20  # a larger file (or /dev/zero) is refused, not read
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")


def synthetic_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int):
    """Deterministic random token ids, every prompt exactly prompt_len long (as in FlexGen's and
    H2O's throughput runs, where prompts are padded to the same length)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab_size, (batch, prompt_len), generator=gen)  # ids 0..3 are special in OPT
    return ids, torch.ones_like(ids)


def load_tokenizer(directory: str | None):
    """The tokenizer next to a model's weights: in its directory, or in its GGUF file; None if none."""
    if directory is not None and directory.lower().endswith(".gguf"):
        from flexh2o.checkpoints.gguf_reader import tokenizer
        return with_source(tokenizer(directory), directory)
    if directory is None or not any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        return None
    for f in TOKENIZER_FILES:
        check_regular_file(os.path.join(directory, f), "--model/--path")
    from flexh2o.checkpoints.tokenizer_files import load_directory_tokenizer
    return with_source(load_directory_tokenizer(directory), directory)


def with_source(tokenizer, source: str):
    tokenizer.flexh2o_source = source  # what its chat template's errors name
    return tokenizer


def template_source(tokenizer) -> str:
    return getattr(tokenizer, "flexh2o_source", None) or getattr(tokenizer, "name_or_path", None) or "the model"


def read_utf8(path: str, flag: str, limit: int, what: str) -> str:
    """A UTF-8 text file of at most `limit` bytes (a leading BOM dropped), read without reading more."""
    check_regular_file(path, flag)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise UsageError(flag, f"cannot read {path}: {e.strerror}") from None
    if len(data) > limit:
        raise UsageError(flag, f"{path} is larger than {format_size(limit)}, the limit for {what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(flag, f"{path} is not UTF-8 text (byte {e.start} cannot be decoded)") from None


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file of at most MAX_PROMPTS_BYTES (a leading BOM dropped), one
    prompt each, so that output n is line n: blank lines at the end are dropped, a blank line
    before a prompt is refused (dropping it would shift every later output's number)."""
    text = read_utf8(path, "--prompts-file", MAX_PROMPTS_BYTES, "a prompts file")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    blank = [n for n, line in enumerate(lines, 1) if not line.strip()]
    if blank:
        more = f" (and {len(blank) - 1} more)" if len(blank) > 1 else ""
        raise UsageError("--prompts-file", f"line {blank[0]} of {path} is blank{more}: the file holds one prompt "
                         "per line, and output n answers line n; remove the blank lines")
    return lines


def chat_turn(tokenizer, line: str) -> str:
    """A prompt as one user turn in the tokenizer's chat template, ready for the assistant's reply."""
    from flexh2o.checkpoints.chat_template import ChatTemplateError, render_chat
    try:
        return render_chat(tokenizer, [{"role": "user", "content": line}], template_source(tokenizer))
    except ChatTemplateError as e:
        raise UsageError("--chat", str(e)) from None


def read_prompts(path: str, tokenizer, batch: int, prompt_len: int, chat: bool = False) -> list[list[int]]:
    """The token ids of one prompt per line; as many prompts as the batch, none over prompt_len.
    chat: each line goes through the tokenizer's chat template as a user turn."""
    if tokenizer is None:
        raise UsageError("--prompts-file", "needs a tokenizer: give --path (or --model) a directory with "
                         "tokenizer files")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError("--chat", "the model's tokenizer has no chat template")
    lines = read_lines(path)
    if len(lines) != batch:
        raise UsageError("--prompts-file", f"{path} has {len(lines)} prompts; the batch "
                         f"(--gpu-batch-size x --num-gpu-batches) is {batch}")
    out = [tokenizer(chat_turn(tokenizer, line), add_special_tokens=False)["input_ids"] if chat
           else tokenizer(line)["input_ids"] for line in lines]
    check_lengths([len(tokens) for tokens in out], prompt_len, path)
    return out


def check_lengths(lengths: list[int], prompt_len: int, path: str):
    """Refuses prompts over prompt_len in one line: how many, the longest and its line, and the
    --prompt-len that would take them all."""
    over = [n for n, length in enumerate(lengths, 1) if length > prompt_len]
    if not over:
        return
    longest = max(over, key=lambda n: lengths[n - 1])
    count = "1 prompt is" if len(over) == 1 else f"{len(over)} prompts are"
    raise UsageError("--prompt-len", f"{count} longer than {prompt_len} tokens in {path}, the longest on line "
                     f"{longest} ({lengths[longest - 1]} tokens): --prompt-len {lengths[longest - 1]} takes them all")


def pad_prompts(prompts: list[list[int]], prompt_len: int, pad_token_id: int):
    """Token ids and mask [len(prompts), prompt_len], each prompt left-padded."""
    ids = torch.full((len(prompts), prompt_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), prompt_len), dtype=torch.long)
    for row, tokens in enumerate(prompts):
        if tokens:
            ids[row, -len(tokens):] = torch.tensor(tokens)
            mask[row, -len(tokens):] = 1
    return ids, mask
