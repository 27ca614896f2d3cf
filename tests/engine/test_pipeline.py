"""Pipeline parallelism: stages holding slices of the layers, micro-batches flowing through them over
gloo, each process one thread; tokens identical and scores within 1e-5 to one process's run, with
weights and cache on disk in some stages, full cache and H2O; every slice holding a decoder layer
(pipeline.py)."""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig

from flexh2o import Engine, Policy
from flexh2o.engine.preflight import run_need
from flexh2o.engine.pipeline import Stage, micro_batches, model_slices, stage_slices
from flexh2o.models.cached_attention import CachedAttention
from flexh2o.models.llama import LlamaSpec
from flexh2o.models.opt import OPTSpec
from flexh2o.engine.stage_link import Link
from conftest import padded_batch
from test_llama import make_tiny_llama


def test_slices_are_contiguous_balanced_by_bytes_and_never_empty():
    assert stage_slices([10, 1, 1, 1, 1, 10], 2) == [range(0, 3), range(3, 6)]
    assert stage_slices([50, 1, 1, 1, 1, 1, 1, 50], 3) == [range(0, 1), range(1, 7), range(7, 8)]
    assert stage_slices([1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    slices = stage_slices([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 4)
    assert [j for s in slices for j in s] == list(range(10)) and all(len(s) for s in slices)
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6, 5, 3][j] for j in s) for s in slices) == 14  # 13 needs 5 slices


def test_every_slice_holds_a_decoder_layer_however_heavy_the_embedding():
    """A tiny OPT of 512 positions: its embedding weighs as much as the rest, so by bytes alone it
    would be a stage by itself; a 4-layer Llama's last quarter, by bytes, is its last MLP and head."""
    heavy, attention = [82, 17, 17, 17, 17, 16], [False, True, False, True, False, False]
    assert stage_slices(heavy, 2) == [range(0, 1), range(1, 6)]
    assert stage_slices(heavy, 2, attention) == [range(0, 2), range(2, 6)]
    with pytest.raises(ValueError):
        stage_slices(heavy, 3, attention)
    opt = OPTSpec(name="opt-512", num_layers=2, hidden_size=32, num_heads=4, ffn_dim=64, vocab_size=128,
                  max_positions=512)
    llama = LlamaSpec(name="llama-4", num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_dim=64,
                      vocab_size=128, max_positions=64)
    for spec, stages in ((opt, 2), (llama, 2), (llama, 3), (llama, 4)):
        layers = spec.build_layers()
        slices = model_slices(layers, 4, stages)
        assert [j for s in slices for j in s] == list(range(len(layers)))
        assert all(any(isinstance(layers[j], CachedAttention) for j in s) for s in slices), (spec.name, slices)


def test_the_preflight_of_a_slice_without_attention_counts_no_cache():
    spec = OPTSpec(name="opt-2", num_layers=2, hidden_size=32, num_heads=4, ffn_dim=64, vocab_size=128)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, cache_gpu_percent=50, cache_cpu_percent=0)
    none, one, two = (run_need(dataclasses.replace(spec, num_layers=n), policy, 4, 8, 4, torch.device("cpu"))
                      for n in (0, 1, 2))
    assert none["disk"] == 0 < one["disk"]
    assert all(two[tier] - one[tier] == one[tier] - none[tier] for tier in ("gpu", "cpu", "disk"))


def test_micro_batches_group_neighbouring_gpu_batches():
    assert micro_batches(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert micro_batches(3, 2) == [range(0, 1), range(1, 3)]
    assert micro_batches(1, 3) == [range(0, 1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_stages(rank, size, port, policy, placements) -> Policy:
    """This spawned rank in the gloo world, one thread; its Policy with its own placement."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    w_gpu, w_cpu, c_gpu, c_cpu = placements[rank]
    return Policy(**policy, w_gpu_percent=w_gpu, w_cpu_percent=w_cpu, cache_gpu_percent=c_gpu,
                  cache_cpu_percent=c_cpu)


def run_stage(rank, size, port, directory, policy, placements, ids, mask, new, limits, out_dir):
    policy = join_stages(rank, size, port, policy, placements)
    offload = os.path.join(out_dir, f"offload{rank}")
    with Engine.load(directory, policy=policy, device="cpu", dtype=torch.float32, offload_dir=offload,
                     stage=Stage(rank, size, 0, Link())) as engine:
        out = engine.generate(ids, mask, max_new_tokens=new, output_scores=True, eos_token_id=None,
                              row_max_new_tokens=limits)
        torch.save({"ids": out.sequences, "scores": out.scores, "layers": engine.layer_indices,
                    "steps": engine.last_stats.steps_done}, os.path.join(out_dir, f"{rank}.pt"))
    assert not os.path.exists(offload) or not os.listdir(offload)
    dist.destroy_process_group()


def alone(directory, policy, ids, mask, new, limits):
    with Engine.from_pretrained(directory, policy=Policy(**policy), device="cpu", dtype=torch.float32) as engine:
        out = engine.generate(ids, mask, max_new_tokens=new, output_scores=True, eos_token_id=None,
                              row_max_new_tokens=limits)
        return out, engine.last_stats.steps_done, len(engine.layers)


MEMORY, DISK, HALF = (100, 0, 100, 0), (0, 0, 0, 0), (50, 0, 0, 50)  # weights gpu/cpu, cache gpu/cpu shares


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pipeline_llama"))
    make_tiny_llama(directory, LlamaConfig, seed=3, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64)
    return directory


CASES = {  # model, stages, gpu-batch size, gpu-batches, KV policy, placement per stage, per-row limits
    "opt-2-full": ("tiny", 2, 2, 2, {}, [MEMORY, DISK], None),
    "opt-3-h2o-disk": ("wide", 3, 1, 3, {"hh_ratio": 0.3}, [DISK, MEMORY, HALF], None),
    "llama-2-h2o-3-per-micro-batch": ("llama", 2, 2, 6, {"hh_ratio": 0.25}, [HALF, DISK], None),
    "llama-3-full-stops-early": ("llama", 3, 2, 3, {}, [MEMORY, HALF, DISK], [1, 3, 2, 2, 3, 1]),
    "opt-2-h2o-2-per-micro-batch": ("tiny", 2, 1, 4, {"hh_ratio": 0.3}, [HALF, MEMORY], None),
    "opt-2-uneven-1-and-2": ("wide", 2, 2, 3, {}, [MEMORY, DISK], None),
}


# Out of make test's 10 minutes (make test-all runs them): there, tests/engine/test_stage_refill.py and
# the command line's pipeline tests (tests/cli/test_distributed.py) cover their ground.
SLOW_CASES = set(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_stages_give_what_one_process_gives(case, tiny_models, llama_dir, tmp_path):
    model, stages, b, nb, kv, placements, limits = CASES[case]
    directory = llama_dir if model == "llama" else tiny_models[model][0]
    ids, mask = padded_batch(b * nb, 7, [2, 0, 1, 0, 3, 0][: b * nb], seed=5)
    policy = dict(gpu_batch_size=b, num_gpu_batches=nb, **kv)
    new = 6
    want, want_steps, num_layers = alone(directory, policy, ids, mask, new, limits)
    mp.spawn(run_stage, args=(stages, free_port(), directory, policy, placements, ids, mask, new, limits,
                              str(tmp_path)), nprocs=stages)
    got = [torch.load(tmp_path / f"{rank}.pt") for rank in range(stages)]
    assert [j for g in got for j in g["layers"]] == list(range(num_layers))
    assert torch.equal(got[0]["ids"], want.sequences)  # the first stage holds the tokens the last chose
    assert torch.equal(got[-1]["ids"], want.sequences)
    scores = got[-1]["scores"]
    assert want_steps <= len(scores) <= want_steps + 1  # a stop is seen at most one step late
    for mine, theirs in zip(scores, want.scores):
        assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
    if limits is not None:
        assert want_steps == max(limits) < new
