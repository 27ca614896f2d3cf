"""Invariants of every eviction policy, driven directly with synthetic attention.

Each token's K carries its own position (and padding a marker), so the cache's contents can be
checked against what the policy claims to hold after every step.
"""

from types import SimpleNamespace

import pytest
import torch

from flexh2o.kv import POLICIES, KVCache, make_policy
from flexh2o.kv.sink import SINKS
from flexh2o.engine.policy import Policy
from flexh2o.offload.tiers import Tiers

EVICTING = [name for name in POLICIES if name != "full"]

B, HEADS, D, PROMPT, GEN = 3, 2, 4, 12, 10
PADS = [0, 3, 8]  # the last sequence has 4 real prompt tokens, fewer than the longest one's budget
PAD_MARK = -999.0
REAL = [PROMPT - n for n in PADS]


def step_at(i: int):
    """What a policy reads of token step i (sequences.Step) on a CPU."""
    return SimpleNamespace(i=i, slot=None, generated_before=lambda device: i - 1)


def budgets(policy):
    """Each sequence's (slots, window, first tokens kept): its own, from its real prompt length."""
    capacity, window, first = policy.budgets(torch.tensor(REAL))
    return list(zip(capacity.tolist(), window.tolist(), first.tolist()))


def token_kv(pos, real):
    """K/V [b, heads, n, D] whose first feature is the token's position (PAD_MARK at padding)."""
    b, n = pos.shape
    k = torch.randn(b, HEADS, n, D)
    k[..., 0] = torch.where(real, pos, torch.full_like(pos, -1)).float()[:, None].expand(b, HEADS, n)
    k[..., 0].masked_fill_(~real[:, None, :].expand(b, HEADS, n), PAD_MARK)
    return k, k.clone()


def attention(cache, g, n_queries=1):
    logits = torch.randn(B, HEADS, n_queries, cache.capacity + 1, generator=g)
    logits[..., :-1].masked_fill_(cache.pos[:, :, None, :] < 0, float("-inf"))
    return logits, torch.softmax(logits, -1)


def run(kv_policy, ratio=0.25, recent=None, seed=0, observe=None):
    """Prompt then GEN decode steps; calls observe(policy, cache, newest, before, probs) after each step."""
    policy = make_policy(Policy(kv_policy=kv_policy, hh_ratio=ratio, recent_ratio=recent), PROMPT, GEN, seed)
    cache = KVCache.allocate(Tiers("cpu", torch.float32), B, HEADS, D, policy.capacity, policy.accumulates)
    real = torch.ones(B, PROMPT, dtype=torch.bool)
    for row, n in enumerate(PADS):
        real[row, :n] = False
    pos = real.long().cumsum(1) * real - 1
    g = torch.Generator().manual_seed(seed + 1)
    k, v = token_kv(pos, real)
    logits = torch.randn(B, HEADS, PROMPT, PROMPT, generator=g)
    logits.masked_fill_(~(real[:, None, None, :] & torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()), -1e9)
    probs = torch.softmax(logits, -1)
    seen = policy.contribution(logits, probs, real[:, None, :, None].float(), step_at(0)) \
        if policy.uses_attention else None
    policy.prompt(cache, k, v, pos.to(torch.int32)[:, None].expand(B, HEADS, PROMPT), seen, step_at(0))
    newest = pos.amax(1)
    check(policy, cache, newest, real.sum(1))
    for i in range(1, GEN):
        newest = newest + 1
        k, v = token_kv(newest[:, None], torch.ones(B, 1, dtype=torch.bool))
        logits, probs = attention(cache, g)
        before = (cache.pos.clone(), None if cache.score is None else cache.score.clone())
        policy.decode(cache, k, v, newest[:, None], logits, probs, step_at(i))
        check(policy, cache, newest, real.sum(1) + i)
        if observe:
            observe(policy, cache, newest, before, probs)
    return cache


def held(cache, row, head):
    return sorted(int(p) for p in cache.pos[row, head] if p >= 0)


def check(policy, cache, newest, tokens_seen):
    assert cache.k.shape[2] == policy.capacity  # preallocated, never grown
    for row, (capacity, window, first) in enumerate(budgets(policy)):
        assert capacity <= policy.capacity
        for head in range(HEADS):
            kept = held(cache, row, head)
            assert len(kept) == min(int(tokens_seen[row]), capacity)  # the sequence's budget never exceeded
            assert len(set(kept)) == len(kept)
            always = set(range(int(newest[row]) - window + 1, int(newest[row]) + 1)) | set(range(first))
            assert set(p for p in always if 0 <= p <= int(newest[row])) <= set(kept)  # the window (and sinks) kept
            slots = cache.pos[row, head] >= 0
            # Positions are absolute and each slot holds its own token: K's marker equals the slot's position.
            assert torch.equal(cache.k[row, head, slots, 0], cache.pos[row, head, slots].float())
            assert not (cache.k[row, head, slots, 0] == PAD_MARK).any()  # padding is never kept


@pytest.mark.parametrize("kv_policy", EVICTING)
def test_invariants_hold_at_every_step(kv_policy):
    run(kv_policy)
    run(kv_policy, ratio=0.1, recent=0.3)


def test_local_keeps_exactly_the_newest():
    def observe(policy, cache, newest, before, probs):
        for row, (capacity, _, _) in enumerate(budgets(policy)):
            want = list(range(max(0, int(newest[row]) - capacity + 1), int(newest[row]) + 1))
            assert held(cache, row, 0) == want
    run("local", observe=observe)


def test_sink_keeps_the_first_four_and_the_newest():
    def observe(policy, cache, newest, before, probs):
        for row, (capacity, _, _) in enumerate(budgets(policy)):
            n = int(newest[row])
            rest = capacity - min(SINKS, capacity - 1)
            want = sorted(set(range(min(SINKS, capacity - 1, n + 1))) | set(range(max(0, n - rest + 1), n + 1)))
            assert held(cache, row, 1) == want
    run("sink", observe=observe)


@pytest.mark.parametrize("kv_policy", ["h2o", "tova"])
def test_the_evicted_token_is_the_least_valued_outside_the_window(kv_policy):
    evictions = []

    def observe(policy, cache, newest, before, probs):
        old_pos, old_score = before
        for row, (_, window, _) in enumerate(budgets(policy)):
            for head in range(HEADS):
                gone = set(int(p) for p in old_pos[row, head] if p >= 0) - set(held(cache, row, head))
                if not gone:
                    continue
                (victim,) = gone
                slots = [s for s in range(policy.capacity)
                         if 0 <= old_pos[row, head, s] <= int(newest[row]) - window]
                if kv_policy == "tova":  # this step's attention
                    value = {int(old_pos[row, head, s]): float(probs[row, head, 0, s]) for s in slots}
                else:  # the accumulated score, this step included
                    value = {int(old_pos[row, head, s]): float(old_score[row, head, s] + probs[row, head, 0, s])
                             for s in slots}
                assert value[victim] == min(value.values())
                evictions.append(victim)
    run(kv_policy, observe=observe)
    assert evictions  # the budget is small enough that tokens are evicted


def test_keyformer_is_seedable_and_its_noise_matters():
    a, b, c = run("keyformer", seed=3), run("keyformer", seed=3), run("keyformer", seed=4)
    assert torch.equal(a.pos, b.pos) and torch.equal(a.score, b.score)
    assert not torch.equal(a.score, c.score)


def test_keyformer_temperature_rises_from_1_to_2():
    policy = make_policy(Policy(kv_policy="keyformer", hh_ratio=0.25), PROMPT, GEN, 0)
    assert policy.temperature(0) == 1.0 and policy.temperature(GEN - 1) == 2.0
    assert policy.temperature(GEN // 2) == pytest.approx(1 + (GEN // 2) / (GEN - 1))


def test_of_equal_scores_the_older_token_is_evicted():
    """Exact ties (every score 0): H2O then keeps the newest tokens, prompt and decode alike."""
    policy = make_policy(Policy(kv_policy="h2o", hh_ratio=0.25), PROMPT, GEN, 0)
    cache = KVCache.allocate(Tiers("cpu", torch.float32), B, HEADS, D, policy.capacity, policy.accumulates)
    pos = torch.arange(PROMPT).expand(B, PROMPT)
    k, v = token_kv(pos, torch.ones(B, PROMPT, dtype=torch.bool))
    step = step_at(0)
    policy.prompt(cache, k, v, pos.to(torch.int32)[:, None].expand(B, HEADS, PROMPT), torch.zeros(B, HEADS, PROMPT), step)
    for newest in range(PROMPT - 1, PROMPT + GEN):
        if newest >= PROMPT:
            k, v = token_kv(torch.full((B, 1), newest), torch.ones(B, 1, dtype=torch.bool))
            zeros = torch.zeros(B, HEADS, 1, policy.capacity + 1)
            policy.decode(cache, k, v, torch.full((B, 1), newest), zeros, zeros, step)
        for row in range(B):
            for head in range(HEADS):
                assert held(cache, row, head) == list(range(newest - policy.capacity + 1, newest + 1))


def test_keyformer_keeps_one_advancing_generator_per_device():
    """A split cache attends on two devices in turn; each device's noise must go on, not restart.
    (tests/offload/test_cuda.py alternates real devices.)"""
    policy = make_policy(Policy(kv_policy="keyformer", hh_ratio=0.25), PROMPT, GEN, 0)
    logits, step = torch.zeros(1, 1, 1, 64), step_at(1)
    first, second = (policy.contribution(logits, None, None, step) for _ in range(2))
    assert not torch.equal(first, second)
    assert list(policy.generators) == [torch.device("cpu")]


def test_keyformer_noise_goes_on_across_device_switches():
    """Draws alternating between two devices continue each device's own stream: the second draw on
    a device is the stream's second draw, not its first again (torch.device("cpu", 0) stands for a
    second device: it compares unequal to "cpu")."""
    policy = make_policy(Policy(kv_policy="keyformer", hh_ratio=0.25), PROMPT, GEN, 7)
    devices = [torch.device("cpu"), torch.device("cpu", 0)]
    draws = {d: [] for d in devices}
    for _ in range(2):
        for d in devices:
            draws[d].append(torch.rand(8, generator=policy.generator(d)))
    expected = torch.Generator().manual_seed(7)
    stream = [torch.rand(8, generator=expected) for _ in range(2)]
    for d in devices:
        assert torch.equal(draws[d][0], stream[0]) and torch.equal(draws[d][1], stream[1])
