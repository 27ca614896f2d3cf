"""Refilled slots (engine/slot_pool.py): a stopped sequence's slot takes the next request, and every
request's tokens are the ones it gets alone, whatever shares its gpu-batch, on every tier."""

import random

import pytest
import torch

from flexh2o import Engine, Policy, UsageError
from flexh2o.engine.slot_request import Request
from flexh2o.kv import POLICIES
from simulated_cuda import SimulatedCuda

EOS = 2


def requests(n: int, seed: int = 0, longest: int = 18, most_tokens: int = 12) -> list[Request]:
    """n prompts of 1..longest tokens asking for 1..most_tokens tokens, in no order."""
    rng = random.Random(seed)
    return [Request([rng.randrange(3, 128) for _ in range(rng.randrange(1, longest + 1))],
                    rng.randrange(1, most_tokens + 1), seed=rng.randrange(1 << 30), tag=n) for n in range(n)]


def alone(directory, reqs, do_sample=False, **policy) -> dict:
    """Each request by itself (batch 1, no padding, fixed batch), up to and with its EOS."""
    out = {}
    with Engine.from_pretrained(directory, policy=Policy(1, **policy), dtype=torch.float32) as engine:
        for r in reqs:
            new = engine.generate(torch.tensor([r.ids]), max_new_tokens=r.max_new_tokens, do_sample=do_sample,
                                  temperature=0.8, row_seeds=[r.seed], eos_token_id=EOS)[0, len(r.ids):].tolist()
            out[r.tag] = new[: new.index(EOS) + 1] if EOS in new else new
    return out


def refilled(directory, reqs, policy, tmp_path, do_sample=False, join_every=1, prompt_chunk=None):
    """(tokens per request tag, the pool, the run's stats)."""
    got = {}

    def done(request, tokens, reason):
        assert request.tag not in got
        assert reason == ("stop" if tokens[-1] == EOS else "length")
        got[request.tag] = tokens
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        pool = engine.generate_refilled(iter(reqs), done, prompt_len=max(len(r.ids) for r in reqs),
                                        gen_len=max(r.max_new_tokens for r in reqs), do_sample=do_sample,
                                        temperature=0.8, eos_token_id=EOS, join_every=join_every,
                                        prompt_chunk=prompt_chunk)
        return got, pool, engine.last_stats


PLACEMENTS = {
    "on the device": {},
    "weights and cache on every tier": dict(w_gpu_percent=0, w_cpu_percent=50, cache_gpu_percent=30,
                                            cache_cpu_percent=30),
    "compressed, cache on disk, activations in CPU memory": dict(
        w_gpu_percent=30, w_cpu_percent=30, cache_gpu_percent=0, cache_cpu_percent=50, act_gpu_percent=0,
        act_cpu_percent=100, compress_weight=True, compress_cache=True),
}
KV = {name: ({} if name == "full" else {"kv_policy": name, "hh_ratio": 0.3})
      for name in POLICIES}


# make test runs each eviction once, the placements taking turns; make test-all runs every pair.
PAIRS = [(p, kv) if list(PLACEMENTS).index(p) == list(KV).index(kv) % len(PLACEMENTS)
         else pytest.param(p, kv, marks=pytest.mark.slow) for p in PLACEMENTS for kv in KV]


@pytest.mark.parametrize("placement,kv", PAIRS)
def test_every_request_gets_what_it_gets_alone(tiny_models, tmp_path, kv, placement):
    """Four slots in two gpu-batches, 20 requests: each slot refilled about five times."""
    directory, _ = tiny_models["tiny"]
    reqs = requests(20, seed=len(kv) + len(placement))
    cache_policy = {k: v for k, v in PLACEMENTS[placement].items() if k.startswith("compress")}
    want = alone(directory, reqs, **KV[kv], **cache_policy)
    policy = Policy(2, num_gpu_batches=2, **KV[kv], **PLACEMENTS[placement])
    got, pool, stats = refilled(directory, reqs, policy, tmp_path)
    assert got == want
    assert pool.joined == 20 and pool.joins > 5
    assert max(pool.row_joins) >= 5  # a slot refilled many times
    assert sum(stats.step_allocations[2:]) == 0  # nothing allocated once the first steps ran
    # A decode step computes the running rows alone: each token but a request's first (its prompt
    # step's) took one decode slot, and a stopped or empty row none.
    assert pool.decode_slots == sum(len(tokens) - 1 for tokens in got.values())


def test_a_sampled_request_draws_from_its_own_seed_in_any_order(tiny_models, tmp_path):
    directory, _ = tiny_models["tiny"]
    reqs = requests(12, seed=5)
    want = alone(directory, reqs, do_sample=True)
    for order in (reqs, reqs[::-1]):
        got, _, _ = refilled(directory, order, Policy(3), tmp_path, do_sample=True)
        assert got == want


def test_joining_every_few_steps_changes_no_tokens(tiny_models, tmp_path):
    directory, _ = tiny_models["wide"]
    reqs = requests(16, seed=2, most_tokens=20)
    every_step, pool_1, _ = refilled(directory, reqs, Policy(4), tmp_path)
    every_4, pool_4, _ = refilled(directory, reqs, Policy(4), tmp_path, join_every=4)
    assert every_4 == every_step
    assert pool_4.joins < pool_1.joins


@pytest.mark.parametrize("placement", list(PLACEMENTS)[:2])
@pytest.mark.parametrize("chunk", [1, 5])
def test_a_long_prompt_joins_in_chunks_and_gets_what_it_gets_alone(tiny_models, tmp_path, placement, chunk):
    """Prompts of up to 30 tokens joining `chunk` tokens per step, beside others decoding."""
    directory, _ = tiny_models["tiny"]
    reqs = requests(14, seed=11, longest=30)
    policy = Policy(2, num_gpu_batches=2, **PLACEMENTS[placement])
    got, pool, stats = refilled(directory, reqs, policy, tmp_path, prompt_chunk=chunk)
    assert got == alone(directory, reqs)
    if chunk == 1:  # every prompt in chunks of one token (or one token long): no padding
        assert pool.prompt_positions == sum(len(r.ids) for r in reqs)
    assert sum(stats.step_allocations[2:]) == 0


@pytest.mark.parametrize("policy", [dict(hh_ratio=0.3), dict(compress_cache=True)])
def test_prompts_in_chunks_need_the_full_uncompressed_cache(tiny_models, policy):
    directory, _ = tiny_models["tiny"]
    with Engine.from_pretrained(directory, policy=Policy(2, **policy), dtype=torch.float32) as engine:
        with pytest.raises(UsageError, match="--prompt-chunk: applies to the full cache"):
            engine.generate_refilled(iter(requests(2)), lambda *a: None, 4, 4, prompt_chunk=2)


def test_prompts_joining_together_are_grouped_to_keep_padding_low(tiny_models, tmp_path):
    """Eight slots filled at once by prompts of 1 to 30 tokens: groups of near lengths, each padded by
    at most a tenth (slot_pool.JOIN_PADDING), where one group would be padded by 30% or more."""
    directory, _ = tiny_models["tiny"]
    reqs = requests(8, seed=12, longest=30)
    got, pool, _ = refilled(directory, reqs, Policy(8), tmp_path)
    assert got == alone(directory, reqs)
    real = sum(len(r.ids) for r in reqs)
    assert real < 0.7 * 8 * max(len(r.ids) for r in reqs)  # one group would pad by 30% or more
    assert pool.prompt_positions * 0.9 <= real


def test_fewer_requests_than_slots_and_none_at_all(tiny_models, tmp_path):
    directory, _ = tiny_models["tiny"]
    reqs = requests(3, seed=4)
    got, pool, _ = refilled(directory, reqs, Policy(4, num_gpu_batches=2), tmp_path)
    assert got == alone(directory, reqs)
    assert pool.joined == 3
    with Engine.from_pretrained(directory, policy=Policy(2), dtype=torch.float32) as engine:
        pool = engine.generate_refilled(iter([]), lambda *a: pytest.fail("nothing to finish"), 4, 4)
        assert pool.joined == 0


def test_join_every_must_be_a_whole_number_of_steps(tiny_models):
    directory, _ = tiny_models["tiny"]
    with Engine.from_pretrained(directory, policy=Policy(2), dtype=torch.float32) as engine:
        with pytest.raises(UsageError, match="join_every"):
            engine.generate_refilled(iter(requests(2)), lambda *a: None, 4, 4, join_every=0)


# The slow ones are in make test-all; prompts joining in chunks on the simulated device are also in
# the CUDA-graph test below.
@pytest.mark.parametrize("placement", [{}, dict(w_gpu_percent=30, w_cpu_percent=40, cache_gpu_percent=34,
                                                cache_cpu_percent=33, act_gpu_percent=0, act_cpu_percent=100,
                                                hh_ratio=0.3),
                                       pytest.param(dict(w_gpu_percent=0, w_cpu_percent=50, cache_gpu_percent=0,
                                                         cache_cpu_percent=100, cpu_cache_compute=True),
                                                    marks=pytest.mark.slow),
                                       dict(cache_gpu_percent=50, cache_cpu_percent=0, compress_cache=True),
                                       pytest.param(dict(w_gpu_percent=50, w_cpu_percent=50, cache_gpu_percent=0,
                                                         cache_cpu_percent=50, prompt_chunk=4),
                                                    marks=pytest.mark.slow)])
def test_refilled_slots_on_a_simulated_cuda_device(tiny_models, tmp_path, monkeypatch, placement):
    """The CUDA branches (streams, per-row slots written through the loaded buffers) give the CPU's
    tokens, with no ordering violation."""
    directory, _ = tiny_models["wide"]
    reqs = requests(10, seed=7)
    placement = dict(placement)
    chunk = placement.pop("prompt_chunk", None)
    policy = Policy(2, num_gpu_batches=2, **placement)
    want, _, _ = refilled(directory, reqs, policy, tmp_path, prompt_chunk=chunk)
    simulated = SimulatedCuda(seed=1)
    mode = simulated.install(monkeypatch)
    try:
        got, _, stats = refilled(directory, reqs, policy, tmp_path, prompt_chunk=chunk)  # "cpu": the simulated device
    finally:
        mode.__exit__(None, None, None)
    simulated.check()
    assert got == want
    if placement:
        assert simulated.copies > 0  # the copies did go through the simulated streams
    assert sum(stats.step_allocations[2:]) == 0


@pytest.mark.parametrize("kv,chunk", [({}, None), ({}, 3), (dict(hh_ratio=0.3), None), (dict(kv_policy="tova",
                                                                                        hh_ratio=0.3), None)])
def test_decode_steps_replay_as_cuda_graphs_while_slots_are_refilled(tiny_models, tmp_path, monkeypatch, kv, chunk):
    """Everything on the (simulated) GPU: each gpu-batch's decode is captured once and replayed, the
    joining prompts run between replays as usual, and every request still gets its tokens alone."""
    directory, _ = tiny_models["wide"]
    reqs = requests(12, seed=13, longest=20, most_tokens=16)
    policy = Policy(2, num_gpu_batches=2, **kv)
    want, _, _ = refilled(directory, reqs, policy, tmp_path, prompt_chunk=chunk)
    simulated = SimulatedCuda(seed=2)
    mode = simulated.install(monkeypatch)
    try:
        got, pool, _ = refilled(directory, reqs, policy, tmp_path, prompt_chunk=chunk)
    finally:
        mode.__exit__(None, None, None)
    simulated.check()
    assert got == want
    assert len(simulated.graphs) == 2 and all(g.replays > 5 for g in simulated.graphs)
    assert pool.decode_slots > sum(len(tokens) - 1 for tokens in got.values())  # a graph computes every row
