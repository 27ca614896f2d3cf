"""The checks of Engine.generate's and generate_refilled's arguments: each refuses a bad one in one
line naming it (a UsageError) before anything runs."""

import math

import torch

from flexh2o.common.arguments import number, shown, switch, token_ids, whole
from flexh2o.common.errors import UsageError
from flexh2o.engine.sampling import MAX_SEED


def check_token_ids(name: str, ids, vocab_size: int):
    """A tensor of whole token ids, each in [0, vocab_size)."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise UsageError(name, f"must be a tensor of integer token ids, got {getattr(ids, 'dtype', type(ids).__name__)}")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise UsageError(name, f"holds token ids outside the vocabulary [0, {vocab_size}): {outside[:3].tolist()}")


def check_generate_arguments(vocab_size: int, do_sample, temperature, top_k, top_p, seed, eos_token_id, pad_token_id,
                             output_scores, progress, stop_check):
    for name, value in (("do_sample", do_sample), ("output_scores", output_scores), ("progress", progress)):
        switch(name, value)
    number("temperature", temperature, 0, math.inf, low_open=True)
    whole("top_k", top_k, 0)
    number("top_p", top_p, 0, 1, low_open=True)
    whole("seed", seed, 0, MAX_SEED, none=True)
    token_ids("eos_token_id", eos_token_id, vocab_size, special=(-1,))
    whole("pad_token_id", pad_token_id, 0, vocab_size - 1, none=True)
    if stop_check is not None and not callable(stop_check):
        raise UsageError("stop_check", f"must be a function (row, tokens) -> bool, or None, got {shown(stop_check)}")


def check_batch(input_ids, attention_mask, batch_size: int, vocab_size: int) -> torch.Tensor:
    """input_ids [batch_size, prompt_len >= 1] and its attention mask (None: every token real),
    which it returns."""
    check_token_ids("input_ids", input_ids, vocab_size)
    if input_ids.dim() != 2 or input_ids.shape[0] != batch_size or input_ids.shape[1] == 0:
        raise UsageError("input_ids", f"must be [gpu_batch_size * num_gpu_batches = {batch_size}, "
                         f"prompt_len >= 1], got {list(input_ids.shape)}")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise UsageError("attention_mask", f"must be a tensor matching input_ids {list(input_ids.shape)}, "
                         f"got {list(getattr(attention_mask, 'shape', [type(attention_mask).__name__]))}")
    if ((attention_mask != 0) & (attention_mask != 1)).any() or not attention_mask.any(dim=1).all():
        raise UsageError("attention_mask", "must hold 0 (padding) and 1 (a token), with a token in every row")
    return attention_mask


def check_positions(prompt_len: int, gen_len: int, spec):
    if prompt_len + gen_len > spec.max_positions:
        raise UsageError("--prompt-len/--gen-len", f"prompt_len + gen_len = {prompt_len + gen_len} exceeds "
                         f"the {spec.max_positions} positions of {spec.name}")


def check_refill_arguments(policy, join_every, prompt_chunk):
    whole("join_every", join_every, 1)
    whole("prompt_chunk", prompt_chunk, 1, none=True)
    if prompt_chunk is not None and (policy.kv_policy != "full" or policy.compress_cache):
        raise UsageError("--prompt-chunk", "applies to the full cache, uncompressed: an evicting policy "
                         "chooses what it keeps from the whole prompt's attention, and a compressed cache "
                         "would hand the later chunks the earlier ones' K and V rounded")
