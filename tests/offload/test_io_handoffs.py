"""Hand-offs to the I/O threads: none when everything is on the compute device (no thread is even
started), at most one per (layer, gpu-batch) when offloading; a group of tasks runs in order, each
with its own outcome."""

import threading

import pytest
import torch
from concurrent.futures import CancelledError

from flexh2o import Engine, Policy
from flexh2o.offload.io_tasks import IOThreads
from conftest import padded_batch

NEW = 5


def run(directory, policy, tmp_path):
    ids, mask = padded_batch(policy.batch_size, 10, pads=[(r * 3) % 8 for r in range(policy.batch_size)], seed=5)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        out = engine.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None)
        return out, engine.last_stats, engine.tiers.io.workers, len(engine.layers)


@pytest.mark.parametrize("nb", [1, 3])
@pytest.mark.parametrize("kv", [{}, {"hh_ratio": 0.3}])
def test_everything_on_the_device_queues_no_io_task(tiny_models, tmp_path, nb, kv):
    directory, _ = tiny_models["wide"]
    _, stats, workers, _ = run(directory, Policy(6 // nb, nb, **kv), tmp_path)
    assert stats.step_io_tasks == [0] * NEW
    assert stats.step_handoffs == [0] * NEW
    assert workers == [], "no I/O thread is started when there is nothing to overlap"


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("nb", [1, 2])
def test_offloading_hands_off_once_per_layer_and_gpu_batch_at_most(tiny_models, tmp_path, nb, compress):
    directory, _ = tiny_models["wide"]
    on_device, *_ = run(directory, Policy(6 // nb, nb), tmp_path)
    # Weights on disk and in CPU memory, the cache split over all three tiers: many tasks a step.
    policy = Policy(6 // nb, nb, 0, 50, 34, 33, compress_weight=compress, compress_cache=compress)
    out, stats, _, num_layers = run(directory, policy, tmp_path)
    if not compress:
        assert torch.equal(out, on_device)
    assert all(0 < h <= num_layers * nb for h in stats.step_handoffs), stats.step_handoffs
    assert all(t > h for t, h in zip(stats.step_io_tasks, stats.step_handoffs)), \
        (stats.step_io_tasks, stats.step_handoffs)


def test_a_group_is_one_hand_off_its_tasks_each_with_its_own_outcome():
    io = IOThreads(2)
    order, release = [], threading.Event()
    try:
        with io.group():
            first = io.submit(lambda: (release.wait(), order.append(1)))
            failing = io.submit(lambda: 1 / 0)
            # A task may wait for one queued before it in the same group: it has run by then.
            last = io.submit(lambda: (first.result(), order.append(3)))
            assert not first.done(), "nothing runs before the group is handed off"
        release.set()
        last.result(timeout=10)
        assert order == [1, 3]
        with pytest.raises(ZeroDivisionError):
            failing.result()
        assert io.handoffs == 1
    finally:
        io.close()


def test_close_cancels_what_has_not_started():
    io = IOThreads(1)
    started, release = threading.Event(), threading.Event()
    running = io.submit(lambda: (started.set(), release.wait()))
    waiting = io.submit(lambda: None)
    started.wait(timeout=10)
    threading.Timer(0.2, release.set).start()
    io.close()
    assert running.done() and not running.exception()
    with pytest.raises(CancelledError):
        waiting.result(timeout=10)


def test_a_blocked_store_holds_back_no_load():
    """A store waits for the step it stores (on CUDA: its copies); the loads queued after it run
    meanwhile, on their own threads, and a load may wait for a store queued before it."""
    io = IOThreads(2)
    release = threading.Event()
    try:
        with io.group():
            stores = [io.submit(release.wait, store=True) for _ in range(2)]
            loads = [io.submit(lambda n=n: n) for n in range(4)]
        assert [load.result(timeout=10) for load in loads] == [0, 1, 2, 3]
        assert not any(store.done() for store in stores)
        after = io.submit(lambda: stores[0].result())  # a load waiting for a blocked store
        release.set()
        assert after.result(timeout=10) is True and all(store.result(timeout=10) for store in stores)
        assert len(io.workers) == 4
    finally:
        release.set()
        io.close()
