"""The Python API refuses bad arguments with a UsageError naming them, runs calls from several
threads one at a time, and refuses a closed engine."""

import os
import threading

import pytest
import torch

from flexh2o import Engine, Policy, UsageError
from conftest import VOCAB, padded_batch


@pytest.fixture
def engine(tiny_models, tmp_path):
    directory, _ = tiny_models["tiny"]
    policy = Policy(gpu_batch_size=2, w_gpu_percent=50, w_cpu_percent=0, cache_gpu_percent=0, cache_cpu_percent=0)
    with Engine.from_pretrained(directory, policy=policy, dtype=torch.float32, offload_dir=str(tmp_path)) as e:
        yield e


def test_generate_from_several_threads_runs_one_call_at_a_time(engine, tmp_path):
    prompts = [padded_batch(2, 6, pads=[0, 1], seed=s) for s in range(4)]
    alone = [engine.generate(ids, mask, max_new_tokens=4, eos_token_id=None) for ids, mask in prompts]
    files = sorted(os.listdir(next(tmp_path.iterdir())))
    results, errors = [None] * 4, []

    def call(n):
        try:
            results[n] = engine.generate(*prompts[n], max_new_tokens=4, eos_token_id=None)
        except BaseException as e:  # noqa: BLE001 - the test reports any
            errors.append(e)
    threads = [threading.Thread(target=call, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert all(torch.equal(a, b) for a, b in zip(alone, results))
    assert sorted(os.listdir(next(tmp_path.iterdir()))) == files  # no cache file left behind


BAD = {
    "ids-above-the-vocabulary": (dict(input_ids=torch.tensor([[5, VOCAB], [5, 6]])), "input_ids"),
    "negative-ids": (dict(input_ids=torch.tensor([[5, -1], [5, 6]])), "input_ids"),
    "float-ids": (dict(input_ids=torch.ones(2, 3)), "input_ids"),
    "empty-prompt": (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), "input_ids"),
    "mask-of-twos": (dict(attention_mask=torch.full((2, 3), 2)), "attention_mask"),
    "a-row-of-padding-only": (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "attention_mask"),
    "fractional-max-new-tokens": (dict(max_new_tokens=2.5), "max_new_tokens"),
    "string-max-new-tokens": (dict(max_new_tokens="4"), "max_new_tokens"),
    "forced-token-outside": (dict(forced_tokens=torch.tensor([[1, VOCAB + 3], [1, 2]]), max_new_tokens=2),
                             "forced_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_argument_is_a_usage_error_naming_it(engine, case):
    changes, name = BAD[case]
    args = dict(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2) | changes
    with pytest.raises(UsageError) as e:
        engine.generate(**args)
    assert e.value.flag == name


def test_a_closed_engine_is_refused(engine):
    engine.close()
    with pytest.raises(UsageError, match="the engine was closed"):
        engine.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2)
