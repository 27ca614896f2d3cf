"""The zig-zag order: per token, per layer, every gpu-batch; weights loaded once per (token, layer);
the cache of the next (layer, gpu-batch) loaded before the current one computes."""

from types import SimpleNamespace

import torch

from flexh2o import Engine, Policy, UsageError
from flexh2o.kv import KVCache
from flexh2o.kv.eviction import FullCache
from flexh2o.engine.schedule import Schedule
from flexh2o.offload.held_weights import held_together
from flexh2o.offload.tiers import Tiers


class RecordingLayer:
    def __init__(self, j, log, looks_up_only=False):
        self.j, self.log, self.looks_up_only = j, log, looks_up_only

    def load_weight(self, k):
        self.log.append(("load_weight", self.j))

    def load_cache(self, i, k):
        self.log.append(("load_cache", i, self.j, k))

    def store_cache(self, i, k):
        self.log.append(("store_cache", i, self.j, k))

    def wait_inputs(self, k):
        pass

    def wait_stores(self):
        self.log.append(("wait_stores", self.j))

    def release_weight(self):
        self.log.append(("release_weight", self.j))

    def forward(self, hidden, step):
        self.log.append(("compute", step.i, self.j, step.k))
        return hidden


class FakeSequences:
    refills = False

    def steps(self, i, nb, device_counters=False):
        return [type("Step", (), {"i": i, "k": k})() for k in range(nb)]

    def refill_steps(self, i, nb):
        return [[] for _ in range(nb)]

    def all_finished(self):
        return False


def test_zig_zag_order():
    log = []
    layers = [RecordingLayer(j, log) for j in range(3)]
    Schedule(layers, FakeSequences(), num_gpu_batches=2, tiers=Tiers("cpu", torch.float32)).run(gen_len=2)
    computes = [e[1:] for e in log if e[0] == "compute"]
    assert computes == [(i, j, k) for i in range(2) for j in range(3) for k in range(2)]
    assert [e for e in log if e[0] == "load_weight"] == [("load_weight", j) for _ in range(2) for j in range(3)]
    releases = [log.index(e) for e in log if e[0] == "release_weight"]
    assert [log[p] for p in releases] == [("release_weight", j) for _ in range(2) for j in range(3)]
    assert all(log[p - 1][0] == "compute" and log[p - 1][3] == 1 for p in releases)  # after the block's last
    for i, j, k in computes:
        position = log.index(("compute", i, j, k))
        assert ("load_cache", i, j, k) in log[:position]
        assert log.count(("load_cache", i, j, k)) == 1
        assert log.count(("store_cache", i, j, k)) == 1
        assert log.index(("store_cache", i, j, k)) > position
        if k == 0 and j + 1 < 3:  # the next layer's weights load while gpu-batch 0 computes
            loads_before = [e for e in log[:position] if e[0] == "load_weight"]
            assert loads_before[-1] == ("load_weight", j + 1)
    # The run ends once every store is done: the last (layer, gpu-batch)'s, then each layer's waited for.
    assert log[-4:] == [("store_cache", 1, 2, 1)] + [("wait_stores", j) for j in range(3)]


def test_the_layers_after_a_lookup_load_while_the_last_layer_computes():
    """An input embedding (lookup only) waits for the tokens the last layer picks: the two layers
    after it load with it, while that last layer computes, once per token; it computes before the
    loads of its own turn are queued (its few small reads first in the device's queue)."""
    log = []
    layers = [RecordingLayer(j, log, looks_up_only=j == 0) for j in range(5)]
    Schedule(layers, FakeSequences(), num_gpu_batches=2, tiers=Tiers("cpu", torch.float32)).run(gen_len=3)
    loads = [e[1] for e in log if e[0] == "load_weight"]
    assert loads == [0, 1, 2, 3, 4] * 3
    for i in (1, 2):  # a decode step's embedding, then layers 1 and 2, queued as the last layer computes
        turn = log[log.index(("compute", i - 1, 3, 1)): log.index(("compute", i - 1, 4, 0))]
        assert [e[1] for e in turn if e[0] == "load_weight"] == [0, 1, 2]
        first = log.index(("compute", i, 0, 0))
        assert log[first + 1] == ("store_cache", i - 1, 4, 1)  # its turn's I/O comes after it
    assert held_together(layers) == [[0, 1, 2], [1, 2], [2, 3], [3, 4], [0, 1, 2, 4]]
    assert held_together([RecordingLayer(j, []) for j in range(3)]) == [[0, 1], [1, 2], [0, 2]]


def test_full_cache_writes_slots_in_place():
    cache = KVCache.allocate(Tiers("cpu", torch.float32), batch=2, kv_heads=3, head_dim=4, capacity=6,
                             with_score=False)
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    prompt = torch.randn(2, 3, 4, 4)
    pos = torch.tensor([[-1, 0, 1, 2], [0, 1, 2, 3]], dtype=torch.int32)[:, None].expand(2, 3, 4)
    full = FullCache(6, 6, 2, 0)
    full.prompt(cache, prompt, prompt + 1, pos, None, None)
    new = torch.randn(2, 3, 1, 4)
    full.decode(cache, new, new, torch.tensor([[3], [4]]), None, None, SimpleNamespace(slot=None, row_slots=None))
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == (k_ptr, v_ptr)
    assert cache.length == 5 and torch.equal(cache.k[:, :, 4], new[:, :, 0])
    assert cache.pos[:, 0].tolist() == [[-1, 0, 1, 2, 3, -1], [0, 1, 2, 3, 4, -1]]


def test_batch_not_matching_the_policy_is_refused(tiny_models):
    directory, _ = tiny_models["tiny"]
    engine = Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=2, num_gpu_batches=2), device="cpu",
                                    dtype=torch.float32)
    try:
        engine.generate(torch.ones(3, 5, dtype=torch.long), max_new_tokens=2)
        raise AssertionError("expected a UsageError")
    except UsageError as e:
        assert "gpu_batch_size * num_gpu_batches = 4" in str(e)
