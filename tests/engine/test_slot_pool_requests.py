"""What a request of a slot pool may bring beyond its prompt (engine/slot_pool.py): its own sampler,
log-probabilities of its tokens and of its prompt, a cancellation from another thread; and a pool
that waits for work instead of ending (a server's)."""

import threading

import pytest
import torch

from flexh2o import Engine, Policy
from flexh2o.engine.sampling import Sampler
from test_slot_pool import EOS, alone, refilled, requests


def test_requests_with_their_own_samplers_share_a_pool(tiny_models, tmp_path):
    """Greedy requests beside requests sampled at two temperatures: each gets what it gets alone."""
    directory, _ = tiny_models["tiny"]
    reqs = requests(12, seed=21)
    hot, warm = Sampler(True, 1.3), Sampler(True, 0.8)
    for n, r in enumerate(reqs):
        r.sampler = (None, hot, warm)[n % 3]
    want = alone(directory, [r for r in reqs if r.sampler is None])
    with Engine.from_pretrained(directory, policy=Policy(1), dtype=torch.float32) as engine:
        for r in reqs:
            if r.sampler is not None:
                new = engine.generate(torch.tensor([r.ids]), max_new_tokens=r.max_new_tokens, do_sample=True,
                                      temperature=r.sampler.temperature, row_seeds=[r.seed],
                                      eos_token_id=EOS)[0, len(r.ids):].tolist()
                want[r.tag] = new[: new.index(EOS) + 1] if EOS in new else new
    got, _, _ = refilled(directory, reqs, Policy(2, num_gpu_batches=2), tmp_path)
    assert got == want
    assert any(got[r.tag] != alone(directory, [r])[r.tag] for r in reqs if r.sampler is not None)  # they sampled


def reference_logprobs(model, ids: list) -> torch.Tensor:
    """transformers' log-probabilities [len(ids) - 1] of each token after the first, float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("chunk", [None, 4])
def test_log_probabilities_of_the_prompt_and_of_each_chosen_token(tiny_models, tmp_path, chunk):
    """A request's prompt tokens (after the first) and its chosen tokens, each with its likeliest
    alternatives, as transformers scores the whole text; whole prompts and prompts in chunks."""
    directory, model = tiny_models["tiny"]
    reqs = requests(6, seed=22, longest=14, most_tokens=8)
    for r in reqs:
        r.logprobs, r.prompt_logprobs = 3, 2
    got, _, _ = refilled(directory, reqs, Policy(2, num_gpu_batches=2), tmp_path, prompt_chunk=chunk)
    for r in reqs:
        text = r.ids + got[r.tag]
        want = reference_logprobs(model, text)
        assert len(r.prompt_scores) == len(r.ids) - 1 and len(r.token_scores) == len(got[r.tag])
        seen = torch.tensor([logprob for logprob, _ in r.prompt_scores + r.token_scores], dtype=torch.float64)
        torch.testing.assert_close(seen, want, atol=1e-4, rtol=0)
        for (logprob, alternatives), n in zip(r.prompt_scores, (2,) * len(r.prompt_scores)):
            assert len(alternatives) == n and alternatives[0][1] >= logprob - 1e-9
        for (logprob, alternatives), token in zip(r.token_scores, got[r.tag]):  # greedy: the likeliest
            assert len(alternatives) == 3 and alternatives[0] == (token, pytest.approx(logprob))


def test_a_cancelled_request_frees_its_row_at_the_next_step(tiny_models, tmp_path):
    """Requests cancelled while running, while taking their prompt in chunks and while waiting: each
    ends as "cancelled" with the tokens it had, its row goes to the next request, and the others
    get what they get alone."""
    directory, _ = tiny_models["tiny"]
    reqs = requests(10, seed=23, most_tokens=12)
    running, chunked, waiting = reqs[0], reqs[1], reqs[9]
    running.ids, chunked.ids = [5, 6, 7], list(range(3, 23))  # the second takes its 20 tokens 4 a step
    running.max_new_tokens = 12
    waiting.cancelled = True
    ended = {}

    def on_token(request, token):  # at the running one's 2nd token the other is mid-prompt; at its 3rd it stops
        chunked.cancelled = chunked.cancelled or len(request.token_scores) == 2
        running.cancelled = len(request.token_scores) == 3

    running.logprobs, running.on_token = 0, on_token
    with Engine.from_pretrained(directory, policy=Policy(2), dtype=torch.float32) as engine:
        pool = engine.generate_refilled(iter(reqs), lambda request, tokens, reason: ended.setdefault(
            request.tag, (reason, list(tokens))), prompt_len=20, gen_len=12, eos_token_id=None, prompt_chunk=4)
    assert ended[running.tag][0] == "cancelled" and len(ended[running.tag][1]) == 3
    assert ended[chunked.tag] == ("cancelled", []) and ended[waiting.tag] == ("cancelled", [])
    with Engine.from_pretrained(directory, policy=Policy(1), dtype=torch.float32) as engine:
        for r in reqs[2:9]:
            want = engine.generate(torch.tensor([r.ids]), max_new_tokens=r.max_new_tokens, eos_token_id=None)
            assert ended[r.tag] == ("length", want[0, len(r.ids):].tolist())
    assert pool.joined == 8  # the one in chunks never started; the one cancelled while it waited never joined


def test_a_pool_that_waits_for_work_takes_requests_as_they_come(tiny_models, tmp_path):
    """The source yields None while nothing is queued; the pool, idle, waits for work (a server's
    engine loop), then takes the requests that came meanwhile and ends when told."""
    directory, _ = tiny_models["tiny"]
    reqs = requests(6, seed=24)
    queue, waits, got = [], [], {}
    ready = threading.Event()

    def source():
        while True:
            yield queue.pop(0) if queue else None

    def wait_for_work():
        waits.append(len(got))
        if len(waits) == 1:
            queue.extend(reqs[:3])
            return True
        if len(waits) == 2:
            queue.extend(reqs[3:])
            return True
        ready.set()
        return False
    with Engine.from_pretrained(directory, policy=Policy(2), dtype=torch.float32) as engine:
        engine.generate_refilled(source(), lambda request, tokens, reason: got.setdefault(request.tag, tokens),
                                 prompt_len=18, gen_len=12, eos_token_id=EOS, wait_for_work=wait_for_work)
    assert ready.is_set() and waits == [0, 3, 6]
    assert got == alone(directory, reqs)
