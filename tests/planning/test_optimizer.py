"""The cost model and the search: terms checked by hand, choices on synthetic profiles, brute force."""

import dataclasses
import itertools

import pytest
import torch

from flexh2o.kv import budget
from flexh2o.engine.preflight import CUBLAS_WORKSPACE_BYTES, add, outside_allocator, run_need, split_as_placed, weight_need
from flexh2o.models.opt import PRESETS, OPTSpec
from flexh2o.planning.cost_model import CostModel, predict
from flexh2o.host.hardware import HardwareProfile, from_dict, load_profile, shipped
from flexh2o.planning.search import caps_of, search, shares
from flexh2o.planning.placement import fits
from flexh2o.engine.policy import Policy
from conftest import TEST_CPU_PROFILE

GB = 1 << 30
SMALL = OPTSpec(name="small", num_layers=4, hidden_size=256, num_heads=4, ffn_dim=1024, vocab_size=1000,
                max_positions=1024)


def gpu_profile(**changes) -> HardwareProfile:
    """A CUDA machine with round figures (overridden by `changes`)."""
    base = dict(name="synthetic", source="test", device="cuda", dtype="float16", gpu_mem=16 * GB, cpu_mem=200 * GB,
                disk_mem=1000 * GB, matmul_flops={"float16": {"1": 1e11, "64": 6.4e12, "4096": 2e13}},
                attention_flops={"float16": 1e13}, device_bandwidth=2e11, cpu_attention_bandwidth=2e10,
                h2d=1e10, d2h=1e10, h2d_pageable=5e9, d2h_pageable=5e9, memcpy=1e10, disk_read=1e9, disk_write=1e9,
                dequant=5e10, layer_overhead=1e-4)
    return HardwareProfile(**(base | changes))


def cpu_profile(**changes) -> HardwareProfile:
    return from_dict(TEST_CPU_PROFILE | changes, "test")


def test_shipped_profiles_load_and_name_their_source():
    assert {"t4", "a100-40g", "h100-80g"} <= set(shipped())
    for name in ("t4", "a100-40g", "h100-80g"):
        p = load_profile(name)
        assert p.name == name and p.device == "cuda" and len(p.source) > 40
        assert p.matmul_rate(4096) >= p.matmul_rate(16) >= p.matmul_rate(1) > 0


def test_matmul_rate_interpolates_in_log_rows_and_holds_the_ends():
    p = gpu_profile(matmul_flops={"float16": {"1": 1e11, "100": 1e13}})
    assert p.matmul_rate(10) == pytest.approx(0.5e13 + 0.5e11)
    assert p.matmul_rate(1000) == 1e13
    assert p.matmul_rate(0.5) == pytest.approx(0.5e11)


def test_weights_on_disk_make_decode_take_their_bytes_over_the_disk():
    """Tiny compute, every weight on a slow disk: a decode step takes the weights' bytes / disk_read."""
    hw = cpu_profile(disk_read=1e8, layer_overhead=0.0)
    policy = Policy(gpu_batch_size=1, w_gpu_percent=0, w_cpu_percent=0)
    p = predict(SMALL, policy, 16, 9, hw)
    # An input embedding reads only the rows it looks up (left out of the prediction).
    weight_bytes = sum(rows["disk"] * rb for layer in SMALL.build_layers()
                       for _, _, rb, rows in split_as_placed(layer, 4, policy)[layer.gathered:])
    assert p.decode_seconds == pytest.approx(8 * weight_bytes / 1e8, rel=0.02)
    assert p.bottleneck["decode"] == "disk"


def test_overlap_off_is_the_sum_and_on_the_max():
    hw = cpu_profile(disk_read=3e8)
    on = Policy(gpu_batch_size=8, w_gpu_percent=50, w_cpu_percent=0)
    off = dataclasses.replace(on, overlap=False)
    t_on, t_off = (predict(SMALL, p, 64, 8, hw).total_seconds for p in (on, off))
    assert t_off > t_on
    model = CostModel(SMALL, 64, 8, hw)
    weights = model.weight_io(on)
    step = model.steps()[1]
    stage = model.stage(on, step, 1, weights, model.cache_stage(on, step))
    busy = [stage.busy(c) for c in ("compute", "h2d", "d2h", "disk")]
    from flexh2o.planning.cost_model import stage_time
    assert stage_time(stage, True) == max(busy) and stage_time(stage, False) == pytest.approx(sum(busy))


def test_an_evicting_policy_reads_its_budget_not_the_whole_sequence():
    hw = gpu_profile(disk_read=1e8)
    full = Policy(gpu_batch_size=4, cache_gpu_percent=0, cache_cpu_percent=0)
    h2o = dataclasses.replace(full, kv_policy="h2o", hh_ratio=0.1)
    model = CostModel(SMALL, 500, 20, hw)
    step = model.steps()[-1]
    disk = {p.kv_policy: model.cache_stage(p, step).busy("disk") for p in (full, h2o)}
    read_full, read_h2o = model.cache_length(full, step.length), model.cache_length(h2o, step.length)
    assert read_h2o == 100 and read_full > 500
    # each step reads the slots in use and writes one
    expected = (read_h2o / hw.disk_read + 1 / hw.disk_write) / (read_full / hw.disk_read + 1 / hw.disk_write)
    assert disk["h2o"] / disk["full"] == pytest.approx(expected, rel=1e-9)
    assert predict(SMALL, h2o, 500, 20, hw).decode_seconds < predict(SMALL, full, 500, 20, hw).decode_seconds


def test_where_the_cpu_computes_a_disk_caches_io_adds_to_the_compute():
    """On a CPU the cache's disk reads and writes take the compute's cores: they add, not overlap."""
    hw = cpu_profile(disk_read=1e8)
    on_disk = Policy(gpu_batch_size=4, cache_gpu_percent=0, cache_cpu_percent=0)
    model = CostModel(SMALL, 500, 20, hw)
    step = model.steps()[-1]
    stage = model.cache_stage(on_disk, step)
    in_memory = model.cache_stage(Policy(gpu_batch_size=4), step)
    assert stage.busy("disk") == 0
    slot = 2 * SMALL.num_kv_heads * SMALL.head_dim * 4
    disk = 4 * slot * (model.cache_length(on_disk, step.length) / hw.disk_read + 1 / hw.disk_write)
    assert stage.busy("compute") > in_memory.busy("compute") + disk


def test_attention_is_the_engines_own_calls_as_the_profile_timed_them():
    """The prompt runs fused unless the policy needs the probabilities; a decode step runs fused over
    the full cache's filled slots, or decode_attention and the bookkeeping over every slot of an
    evicting policy's budget; one call per gpu-batch, each with its fixed part."""
    hw = cpu_profile()
    calls = hw.attention_costs
    full = Policy(gpu_batch_size=4, num_gpu_batches=2)
    h2o = dataclasses.replace(full, kv_policy="h2o", hh_ratio=0.1)
    model = CostModel(SMALL, 100, 8, hw)
    prompt, decode = model.steps()[0], model.steps()[-1]
    heads, d = SMALL.num_heads, SMALL.head_dim

    def line(name, units):
        fixed, per_unit = calls[name]
        return 2 * (fixed + units * per_unit)  # two gpu-batches
    prompt_units = 4 * heads * 100 * 100 * d / 64
    assert model._attention(full, prompt, {"cpu": 0}).busy("compute") == pytest.approx(
        line("prompt_fused", prompt_units))
    assert model._attention(h2o, prompt, {"cpu": 0}).busy("compute") == pytest.approx(
        line("prompt_observed", prompt_units))
    filled = model.cache_length(full, decode.length) + 1
    assert model._attention(full, decode, {"cpu": 0}).busy("compute") == pytest.approx(
        line("decode_fused", 4 * heads * filled * d / 64))
    capacity = budget(h2o, 100, 8)[0]
    assert model._attention(h2o, decode, {"cpu": 0}).busy("compute") == pytest.approx(
        line("decode_evicting", 4 * heads * (capacity + 1) * d / 64))


def test_a_profile_without_attention_calls_goes_by_its_rates():
    data = dict(TEST_CPU_PROFILE)
    del data["attention_costs"]
    hw = from_dict(data, "test")
    assert hw.attention_costs is None
    full = Policy(gpu_batch_size=4)
    model = CostModel(SMALL, 100, 8, hw)
    s = 100
    products = 4 * 4 * SMALL.num_heads * s * s * SMALL.head_dim
    probs = 4 * SMALL.num_heads * s * s * 4 * 4
    assert model._attention(full, model.steps()[0], {"cpu": 0}).busy("compute") == pytest.approx(
        products / hw.attention_flops["float32"] + probs / hw.device_bandwidth)
    assert predict(SMALL, dataclasses.replace(full, kv_policy="h2o", hh_ratio=0.2), 100, 8, hw).total_seconds > 0


def test_compression_shrinks_disk_time_and_adds_dequantization_once_per_load():
    hw = cpu_profile(disk_read=1e8)
    plain = Policy(gpu_batch_size=4, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=0)
    packed = dataclasses.replace(plain, compress_weight=True)
    model = CostModel(SMALL, 32, 4, hw)
    a, b = model.weight_io(plain)[1], model.weight_io(packed)[1]
    h = SMALL.hidden_size  # attention: q/k/v in one matrix and the output matrix (its vectors stay in memory)
    matrices = 3 * h * h + h * h
    assert a.busy("disk") == pytest.approx(matrices * 4 / 1e8)
    assert b.busy("disk") == pytest.approx(matrices * 36 / 64 / 1e8)  # 36-byte groups of 64
    for step in model.steps():  # no kernel timed in this profile: widened at every load, once for both gpu-batches
        extra = model.compute(packed, step, 1).busy("compute") - model.compute(plain, step, 1).busy("compute")
        assert extra == pytest.approx(matrices / hw.dequant)


@pytest.mark.parametrize("weights", [(0, 100), (100, 0)])
def test_on_cuda_dequantizing_is_on_the_load_stream_behind_the_copies(weights):
    """On CUDA a compressed matrix is widened on the load stream at every load, wherever its groups
    are (weight_io.py): h2d time, once per layer per step, none of it compute."""
    hw = gpu_profile()
    plain = Policy(gpu_batch_size=4, num_gpu_batches=2, w_gpu_percent=weights[0], w_cpu_percent=weights[1])
    packed = dataclasses.replace(plain, compress_weight=True)
    model = CostModel(SMALL, 32, 4, hw)
    h = SMALL.hidden_size
    matrices = 3 * h * h + h * h
    copies = matrices * 36 / 64 / hw.h2d if weights[1] else 0.0
    assert model.weight_io(packed)[1].busy("h2d") == pytest.approx(copies + matrices / hw.dequant)
    for step in model.steps():
        compute = model.compute(packed, step, 1).busy("compute")
        assert compute == pytest.approx(model.compute(plain, step, 1).busy("compute"))


def test_a_timed_unwidened_kernel_replaces_dequantizing_for_steps_of_few_rows():
    rate = {"1": 1e9, "8": 8e9, "32": 3.2e10}
    hw = cpu_profile(int4_matmul_flops={"float32": rate})
    plain = Policy(gpu_batch_size=8, num_gpu_batches=2)
    packed = dataclasses.replace(plain, compress_weight=True)
    model = CostModel(SMALL, 32, 4, hw)
    prompt, decode = model.steps()[0], model.steps()[1]
    h = SMALL.hidden_size
    flops = 2 * 8 * 4 * h * h  # decode: 8 rows through q, k, v and the output matrix
    assert model.compute(packed, decode, 1).busy("compute") == pytest.approx(
        2 * (flops / 8e9 + hw.layer_overhead))
    # The prompt step's 8 x 32 rows are past the kernel's limit (32): widened once, full-width products.
    extra = model.compute(packed, prompt, 1).busy("compute") - model.compute(plain, prompt, 1).busy("compute")
    assert extra == pytest.approx(4 * h * h / hw.dequant)
    # bfloat16 has no timed kernel in this profile: widened there, at every step.
    bf16 = CostModel(SMALL, 32, 4, hw, dtype="bfloat16")
    extra = bf16.compute(packed, decode, 1).busy("compute") - bf16.compute(plain, decode, 1).busy("compute")
    assert extra == pytest.approx(4 * h * h / hw.dequant)


def need_of(spec, policy, dtype_bytes, prompt_len, gen_len, device):
    return add(weight_need(spec.build_layers(), dtype_bytes, policy, device),
               run_need(spec, policy, dtype_bytes, prompt_len, gen_len, device))


def test_everything_on_the_device_when_it_fits():
    hw = gpu_profile()
    plan = search(SMALL, 64, 16, hw, caps_of(hw), Policy(), max_batch=16)
    assert (plan.policy.w_gpu_percent, plan.policy.cache_gpu_percent) == (100, 100)


def test_never_exceeds_a_cap():
    hw = gpu_profile()
    spec = PRESETS["opt-1.3b"]
    for gpu_mem in (2 * GB, 3 * GB, 4 * GB):
        caps = caps_of(hw, gpu_mem=gpu_mem, cpu_mem=4 * GB)
        plan = search(spec, 128, 8, hw, caps, Policy(), max_batch=64)
        need = need_of(spec, plan.policy, 2, 128, 8, torch.device("cuda"))
        assert need["gpu"] <= gpu_mem and need["cpu"] <= 4 * GB
        assert fits(spec, plan.policy, 2, 128, 8, caps, torch.device("cuda"))


def test_moves_the_cache_before_the_weights_when_that_is_cheaper():
    """The GPU holds the weights or a long prompt's cache, not both. Attention on the CPU is fast
    here, so a cache in CPU memory costs little; weights in CPU memory cross a slow bus every step."""
    spec = PRESETS["opt-350m"]  # 0.66 GB of weights; the cache of 16 x (1024 + 16) tokens: 1.6 GB
    gpu_mem = int(1.94 * GB) + outside_allocator(False) + CUBLAS_WORKSPACE_BYTES  # 1.94 GB for the run itself
    hw = gpu_profile(gpu_mem=gpu_mem, h2d=2e9, cpu_attention_bandwidth=1e11)
    plan = search(spec, 1024, 16, hw, caps_of(hw), Policy(), total_batch=16)
    assert plan.policy.w_gpu_percent == 100 and plan.policy.cache_gpu_percent < 100
    # ... and the weights first where they are the cheaper to move: attention on the CPU is slow, so a
    # cache in CPU memory crosses the bus every step, and it is more bytes than the weights.
    hw = gpu_profile(gpu_mem=gpu_mem, h2d=2e9, cpu_attention_bandwidth=1e8)
    plan = search(spec, 1024, 16, hw, caps_of(hw), Policy(), total_batch=16)
    assert plan.policy.cache_gpu_percent == 100 and plan.policy.w_gpu_percent < 100


def test_prefers_h2o_for_its_larger_batch():
    hw = load_profile("t4")
    spec = PRESETS["opt-6.7b"]
    full = search(spec, 512, 32, hw, caps_of(hw), Policy(), num_gpu_batches=(1,))
    h2o = search(spec, 512, 32, hw, caps_of(hw), Policy(hh_ratio=0.1), num_gpu_batches=(1,))
    assert h2o.policy.batch_size > full.policy.batch_size
    assert h2o.predicted.total_throughput > full.predicted.total_throughput


def brute_force(spec, prompt_len, gen_len, hw, caps, base, batch_sizes, gpu_batches, step):
    """The best predicted total throughput over every policy of a small space, checked with the
    engine's own pre-flight (placement.fits) one policy at a time."""
    device, best = torch.device(hw.device), (0.0, None)
    for b, nb, (wg, wc), (cg, cc), act, ccc in itertools.product(
            batch_sizes, gpu_batches, shares(step), shares(step), ((100, 0), (0, 100)), (False, True)):
        if hw.device == "cpu" and (ccc or act != (100, 0)) or nb == 1 and act != (100, 0):
            continue
        p = dataclasses.replace(base, gpu_batch_size=b, num_gpu_batches=nb, w_gpu_percent=wg, w_cpu_percent=wc,
                                cache_gpu_percent=cg, cache_cpu_percent=cc, act_gpu_percent=act[0],
                                act_cpu_percent=act[1], cpu_cache_compute=ccc)
        if fits(spec, p, 2 if hw.device == "cuda" else 4, prompt_len, gen_len, caps, device):
            t = predict(spec, p, prompt_len, gen_len, hw).total_throughput
            if t > best[0]:
                best = (t, p)
    return best


@pytest.mark.parametrize("device,kv", [  # the CUDA cases out of make test's 10 minutes (make test-all)
    pytest.param("cuda", {}, marks=pytest.mark.slow), pytest.param("cuda", {"hh_ratio": 0.2}, marks=pytest.mark.slow),
    ("cpu", {}), ("cpu", {"hh_ratio": 0.2})])
def test_search_finds_what_brute_force_finds(device, kv):
    # Tight enough that the weights (8 MB in float16) and a batch's cache compete for the fast tiers,
    # beyond what the pre-flight sets aside (CUDA's memory outside the allocator and cuBLAS's
    # workspaces; the process itself on a CPU).
    set_aside = outside_allocator(False) + CUBLAS_WORKSPACE_BYTES
    hw = gpu_profile(gpu_mem=set_aside + (6 << 20), cpu_mem=24 << 20, h2d=2e9) if device == "cuda" else \
        cpu_profile(gpu_mem=6 << 20, cpu_mem=(1 << 30) + (14 << 20), disk_read=3e8)
    caps = caps_of(hw)
    base = Policy(**kv)
    # gen_len 6: every decode step is scored, by the search and by predict alike
    best, policy = brute_force(SMALL, 64, 6, hw, caps, base, (1, 2, 4), (1, 2), 25)
    plan = search(SMALL, 64, 6, hw, caps, base, tolerance=0.0, step=25, gpu_batch_sizes=(1, 2, 4), num_gpu_batches=(1, 2))
    assert policy is not None
    assert plan.predicted.total_throughput == pytest.approx(best, rel=1e-9)


def test_a_cache_share_with_sequences_on_disk_says_disk():
    """batch_split rounds half to even: (50, 50) of one sequence puts it on disk; the share shown
    for that split must be the one whose percentages say so."""
    from flexh2o.kv.home import batch_split
    from flexh2o.planning.search import cache_shares
    for batch in (1, 2, 3, 4, 6, 12):
        for g, c in cache_shares(batch, 5):
            rows = batch_split(batch, g, c)
            assert (rows["disk"] > 0) == (100 - g - c > 0), (batch, g, c, rows)
            assert (rows["cpu"] > 0) == (c > 0) and (rows["gpu"] > 0) == (g > 0), (batch, g, c, rows)
