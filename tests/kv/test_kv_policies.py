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
    return SimpleNamespace(i=i, prefill=i == 0, slot=None, generated_before=lambda device: i - 1, row_seeds=None,
                           row_gen_lens=None, before=None, row_slots=None)


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


def test_keyformer_noise_is_a_function_of_where_the_logit_sits():
    """The noise of a logit follows (layer seed, sequence seed, head, query position, key position)
    alone: a sequence gets the same in a batch of three as alone, in another slot order, and other
    noise under another seed, head or layer."""
    policy = make_policy(Policy(kv_policy="keyformer", hh_ratio=0.25), PROMPT, GEN, 5)
    logits = torch.zeros(3, 2, 1, 6)
    keys = torch.tensor([[4, 0, 1, 2, 3, 5], [3, 4, 0, 1, 2, 5], [0, 1, 2, 3, 4, 5]]).view(3, 1, 1, 6)

    def at(rows):
        return lambda: (torch.arange(len(rows)).view(-1, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1),
                        torch.full((len(rows), 1, 1, 1), 5), keys[rows])
    step = SimpleNamespace(i=3, prefill=False, row_seeds=torch.tensor([11, 12, 11]), row_gen_lens=None)
    batch = policy.contribution(logits, None, None, step, at([0, 1, 2]))
    alone = SimpleNamespace(i=3, prefill=False, row_seeds=torch.tensor([12]), row_gen_lens=None)
    assert torch.equal(policy.contribution(logits[1:2], None, None, alone, at([1])), batch[1:2])
    # Rows 0 and 2 share a seed: the same noise for the same positions, in whichever slots they are
    # (the softmax's sum, taken in another order, may differ in its last bit).
    torch.testing.assert_close(batch[0].gather(-1, keys[0, 0].argsort().expand(2, 6)),
                               batch[2].gather(-1, keys[2, 0].argsort().expand(2, 6)), rtol=1e-6, atol=1e-8)
    assert not torch.equal(batch[0, 0], batch[0, 1])  # another head
    other = SimpleNamespace(i=3, prefill=False, row_seeds=torch.tensor([13, 12, 11]), row_gen_lens=None)
    assert not torch.equal(policy.contribution(logits, None, None, other, at([0, 1, 2]))[0], batch[0])
    other_layer = make_policy(Policy(kv_policy="keyformer", hh_ratio=0.25), PROMPT, GEN, 6)
    assert not torch.equal(other_layer.contribution(logits, None, None, step, at([0, 1, 2])), batch)


def test_hashed_uniforms_are_uniform_in_the_open_interval():
    from flexh2o.kv.keyformer import hashed_uniforms
    u = hashed_uniforms((3, torch.arange(64).view(-1, 1), torch.arange(4096)), "cpu")
    assert u.shape == (64, 4096) and u.dtype == torch.float32
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 60  # chi-square, 15 degrees of freedom: p < 1e-6
    neighbours = torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()])
    assert abs(float(torch.corrcoef(neighbours)[0, 1])) < 0.02
    assert torch.equal(hashed_uniforms((3, torch.tensor(7)), "cpu"), hashed_uniforms((3, 7), "cpu"))
    assert not torch.equal(hashed_uniforms((3, 7), "cpu"), hashed_uniforms((4, 7), "cpu"))


def test_keyformer_temperature_follows_each_sequences_own_max_new_tokens():
    """Each sequence's tau runs from 1 to 2 over its own max_new_tokens (refilled slots, or a fixed
    batch of a job's records); a prompt's is 1."""
    policy = make_policy(Policy(kv_policy="keyformer", hh_ratio=0.25), PROMPT, GEN, 0)
    step = SimpleNamespace(i=9, prefill=False, before=torch.tensor([0, 3, 4]), row_gen_lens=torch.tensor([5, 5, 9]),
                           row_slots=torch.tensor([7, 8, 9]))
    tau = policy.temperatures(step, torch.zeros(3, 2, 1, 6))
    assert tau.flatten().tolist() == pytest.approx([1 + 1 / 4, 2.0, 1 + 5 / 8])
    fixed = SimpleNamespace(i=3, prefill=False, before=None, row_gen_lens=torch.tensor([4, 7]), row_slots=None)
    assert policy.temperatures(fixed, torch.zeros(2, 2, 1, 6)).flatten().tolist() == pytest.approx([2.0, 1.5])
    assert policy.temperatures(SimpleNamespace(prefill=True), torch.zeros(3, 2, 4, 4)) == 1.0
