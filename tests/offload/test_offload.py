"""Offloading: any placement of weights, cache and activations gives the all-on-device output;
each tier gets its share of bytes; the offload dir is left empty; pre-flight refuses what cannot fit."""

import os
import subprocess
import sys

import pytest
import torch

from flexh2o import Engine, Policy, UsageError
from flexh2o.offload.buffers import TIERS
from conftest import REPO, generate_leaving_nothing, hf_generate, padded_batch

WEIGHTS = [(100, 0), (50, 50), (50, 0), (0, 100), (0, 50), (0, 0)]
CACHE = {"gpu": (100, 0), "cpu": (0, 100), "disk": (0, 0), "mixed": (34, 33)}


def generate(directory, policy, tmp_path, new_tokens=6, **kw):
    ids, mask = padded_batch(policy.batch_size, 10, pads=[(r * 3) % 8 for r in range(policy.batch_size)], seed=5)
    return generate_leaving_nothing(directory, policy, ids, mask, tmp_path, new_tokens, **kw)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """transformers' output for the batch every placement runs."""
    directory, model = tiny_models["wide"]
    ids, mask = padded_batch(6, 10, pads=[(r * 3) % 8 for r in range(6)], seed=5)
    return hf_generate(model, ids, mask, 6)


CASES = [(w, c, nb, overlap, act)
         for n, (w, c) in enumerate((w, c) for w in WEIGHTS for c in CACHE)
         for nb, overlap, act in [((1, 3)[n % 2], n % 3 != 0, ("gpu", "cpu")[n % 2 == 1 and n % 4 == 1])]]


@pytest.mark.parametrize("weights,cache,num_gpu_batches,overlap,act", CASES,
                         ids=[f"w{w[0]}-{w[1]}_cache-{c}_nb{nb}_{'ov' if o else 'seq'}_act-{a}" for w, c, nb, o, a in CASES])
def test_every_placement_gives_the_same_output(tiny_models, reference, tmp_path, weights, cache, num_gpu_batches,
                                               overlap, act):
    directory, _ = tiny_models["wide"]
    policy = Policy(gpu_batch_size=6 // num_gpu_batches, num_gpu_batches=num_gpu_batches,
                    w_gpu_percent=weights[0], w_cpu_percent=weights[1],
                    cache_gpu_percent=CACHE[cache][0], cache_cpu_percent=CACHE[cache][1],
                    act_gpu_percent=100 if act == "gpu" else 0, act_cpu_percent=100 if act == "cpu" else 0,
                    overlap=overlap)
    out = generate(directory, policy, tmp_path, bypass_page_cache=not overlap)
    assert torch.equal(out.sequences, reference.sequences)
    for mine, theirs in zip(out.scores, reference.scores):
        assert torch.allclose(mine, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("gpu,cpu", [(20, 30), (50, 50), (0, 70), (33, 33)])
def test_each_tier_gets_its_share_of_every_layer(tiny_models, tmp_path, gpu, cpu):
    directory, _ = tiny_models["wide"]
    policy = Policy(gpu_batch_size=1, w_gpu_percent=gpu, w_cpu_percent=cpu)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        asked = {"gpu": gpu, "cpu": cpu, "disk": 100 - gpu - cpu}
        for layer in engine.layers:
            # the LM head's layer stays on the compute device whatever the shares
            asked_here = {"gpu": 100, "cpu": 0, "disk": 0} if layer.one_of_a_kind else asked
            placed = {t: 0 for t in TIERS}
            for home in layer.home:
                row_bytes = torch.Size(home.shape[1:]).numel() * 4
                for seg in home.segments:
                    placed[seg.tier] += (seg.stop - seg.start) * row_bytes
            total = sum(placed.values())
            for tier in TIERS:
                assert abs(placed[tier] / total * 100 - asked_here[tier]) <= 5, (type(layer).__name__, placed)


def test_offload_dir_is_emptied_when_a_run_fails(tiny_models, tmp_path):
    directory, _ = tiny_models["tiny"]
    policy = Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=0, cache_gpu_percent=0, cache_cpu_percent=0)
    with pytest.raises(UsageError):
        with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                    offload_dir=str(tmp_path)) as engine:
            assert len(os.listdir(tmp_path)) == 1 and os.listdir(os.path.join(tmp_path, os.listdir(tmp_path)[0]))
            engine.generate(torch.ones(3, 4, dtype=torch.long))  # wrong batch: fails
    assert os.listdir(tmp_path) == []


def test_preflight_refuses_a_policy_that_cannot_fit(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flexh2o.run", "--model", "opt-1.3b", "--dummy", "--gpu-mem", "1GB",
                        "--weights", "gpu=100", "--offload-dir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "needs" in r.stderr and "compute device (CPU) tier, which holds 1.00 GB" in r.stderr
    assert os.listdir(tmp_path) == []


def test_generate_does_not_count_the_loaded_weights_twice(tiny_models, monkeypatch):
    """The check in generate compares against the memory that was free before the weights were
    loaded; measuring it again then would count the weights twice and refuse a run that fits."""
    import flexh2o.engine.preflight as memory

    class Memory:
        available = 4 << 30
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: Memory)
    directory, _ = tiny_models["tiny"]
    with Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=2), device="cpu", dtype=torch.float32,
                                prompt_len=6, gen_len=2) as engine:
        Memory.available = 1000  # the weights now fill what was free
        engine.generate(torch.randint(3, 100, (2, 6)), max_new_tokens=2)


@pytest.mark.parametrize("w_gpu,w_cpu,nb", [(30, 0, 1), (0, 40, 2), (55, 20, 3), (0, 0, 1)])
def test_preflight_projection_bounds_the_tracked_peak(tiny_models, tmp_path, w_gpu, w_cpu, nb):
    """What the pre-flight projects for the compute tier is never below what the run allocates there."""
    from flexh2o.engine.preflight import run_need, weight_need
    directory, _ = tiny_models["wide"]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=nb, w_gpu_percent=w_gpu, w_cpu_percent=w_cpu,
                    cache_gpu_percent=50, cache_cpu_percent=0, hh_ratio=0.5)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        ids, mask = padded_batch(2 * nb, 8, pads=[0] * 2 * nb)
        engine.generate(ids, mask, max_new_tokens=4)
        projected = weight_need(engine.layers, 4, policy, engine.tiers.compute)["gpu"] + \
            run_need(engine.spec, policy, 4, 8, 4, engine.tiers.compute)["gpu"]
        assert engine.tiers.peak["gpu"] <= projected
