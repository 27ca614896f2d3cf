"""What a decode step copies to the compute device, counted where the copies happen (the figure
`make gpu-check` divides by the host-to-device bandwidth for its bounds): with every weight on
disk and the cache on the device, each step reads each weight exactly once."""

import pytest
import torch
from transformers import LlamaConfig

from flexh2o import Engine, Policy
from test_llama import make_tiny_llama


def decode_step_bytes(directory, tmp_path) -> tuple[list, int]:
    """Bytes copied to the compute device in each decode step but the last (which prefetches
    nothing), and the model's weight bytes (a tied matrix once)."""
    # Weights on disk, cache on the device; overlap off, so that each copy counts in the step that queued
    # it (an I/O thread may run a prefetch for the next token on either side of a step's end).
    policy = Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=0, overlap=False)
    with Engine.from_pretrained(directory, policy=policy, dtype=torch.float32, offload_dir=str(tmp_path)) as engine:
        engine.generate(torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0)),
                        max_new_tokens=6, eos_token_id=None)
        return engine.last_stats.step_h2d_bytes[1:-1], engine.spec.param_count() * 4


def test_each_weight_is_read_once_per_token(tmp_path):
    directory = tmp_path / "llama"
    make_tiny_llama(str(directory), LlamaConfig, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64)
    steps, weights = decode_step_bytes(str(directory), tmp_path)
    assert steps == [weights] * 4


@pytest.mark.xfail(strict=True, reason="issue 23, point 4: a tied embedding is placed and read twice per token, "
                                       "once as the input embedding and once as the LM head")
def test_a_tied_embedding_is_read_once_per_token(tiny_models, tmp_path):
    directory, _ = tiny_models["tiny"]
    steps, weights = decode_step_bytes(directory, tmp_path)
    assert steps == [weights] * 4
