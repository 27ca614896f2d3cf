"""Decode steps as CUDA graphs (flexh2o/decode_graphs.py), on the simulated device: a replay runs the
captured ops again and no Python code (simulated_graphs.py), so whatever a step worked out on the
host would come back stale and change the tokens."""

import dataclasses

import pytest
import torch

from flexh2o.engine import decode_graphs
from flexh2o.kv import POLICIES
from test_simulated_cuda import MATRIX, NEW_TOKENS, assert_same, cpu_reference, policy, simulated_run

# Every KV policy but Keyformer, which is never captured (decode_graphs.why_not)
GRAPHED = {name: dict(kv_policy=name, hh_ratio=0.3) if name != "full" else {} for name in POLICIES if name != "keyformer"}
REPLAYED_STEPS = NEW_TOKENS - decode_graphs.DecodeGraphs.first  # captured at that step, replayed from it on


def on_gpu(batches=2, **kv):
    return policy(batches=batches, **kv)


@pytest.mark.parametrize("kv", list(GRAPHED))
def test_replayed_decode_steps_give_the_tokens_of_the_cpu(tiny_models, tmp_path, monkeypatch, kv):
    directory, _ = tiny_models["wide"]
    run = on_gpu(**GRAPHED[kv])
    reference = cpu_reference(directory, run, tmp_path)
    out, stats, simulated = simulated_run(directory, run, tmp_path, monkeypatch)
    assert_same(reference, out)
    assert len(simulated.graphs) == run.num_gpu_batches  # one per gpu-batch
    assert [g.replays for g in simulated.graphs] == [REPLAYED_STEPS] * run.num_gpu_batches
    assert stats.step_allocations[2:] == [0] * (NEW_TOKENS - 2)


def test_sampled_and_grouped_heads_replay_alike(tmp_path, monkeypatch):
    """Sampling (its random numbers copied in per step) on a Llama with grouped KV heads, H2O."""
    from test_llama import MODELS, make_tiny_llama
    config_class, overrides = MODELS["wide"]
    directory = str(tmp_path / "llama")
    make_tiny_llama(directory, config_class, seed=4, **overrides)
    run = on_gpu(hh_ratio=0.3)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=20, seed=11)
    from test_simulated_cuda import generate
    reference, _ = generate(directory, run, tmp_path, kwargs)
    out, _, simulated = simulated_run(directory, run, tmp_path, monkeypatch, generate_kwargs=kwargs)
    assert_same(reference, out)
    assert [g.replays for g in simulated.graphs] == [REPLAYED_STEPS] * run.num_gpu_batches


@pytest.mark.parametrize("name,run", [("keyformer", on_gpu(kv_policy="keyformer", hh_ratio=0.3)),
                                      ("weights streamed", MATRIX["weights-cpu"]),
                                      ("cache streamed", MATRIX["cpu-cache-compute"])])
def test_no_graph_where_a_step_cannot_be_replayed(tiny_models, tmp_path, monkeypatch, name, run):
    directory, _ = tiny_models["wide"]
    reference = cpu_reference(directory, run, tmp_path)
    out, _, simulated = simulated_run(directory, run, tmp_path, monkeypatch)
    assert_same(reference, out)
    assert simulated.graphs == []


def test_a_failed_capture_is_one_line_and_the_run_goes_on(tiny_models, tmp_path, monkeypatch, capfd):
    """A capture that meets what a graph cannot hold (here: the host reading a device value)."""
    directory, _ = tiny_models["wide"]
    run = on_gpu()
    reference = cpu_reference(directory, run, tmp_path)
    capfd.readouterr()
    pick = type(None)

    def reads_on_the_host(self, logits, uniforms):
        float(logits[0, 0])
        return pick(self, logits, uniforms)
    from flexh2o.engine.sequences import Sequences
    pick = Sequences.pick
    monkeypatch.setattr(Sequences, "pick", reads_on_the_host)
    out, _, simulated = simulated_run(directory, run, tmp_path, monkeypatch)
    assert_same(reference, out)
    lines = [line for line in capfd.readouterr().err.splitlines() if "CUDA graph" in line]
    assert len(lines) == 1 and "capture failed" in lines[0] and "decoding without graphs" in lines[0], lines
    assert all(g.replays == 0 for g in simulated.graphs)


def test_graphs_can_be_turned_off(tiny_models, tmp_path, monkeypatch):
    directory, _ = tiny_models["wide"]
    monkeypatch.setenv("FLEXH2O_CUDA_GRAPHS", "0")
    run = on_gpu()
    out, _, simulated = simulated_run(directory, run, tmp_path, monkeypatch)
    assert_same(cpu_reference(directory, run, tmp_path), out)
    assert simulated.graphs == []


def test_a_stale_slot_would_show(tiny_models, tmp_path, monkeypatch):
    """The check itself: a full cache that picks its slot on the host (a Python int, baked into the
    graph at capture) gives other tokens once replayed."""
    from flexh2o.kv.eviction import FullCache
    monkeypatch.setattr(FullCache, "decode", lambda self, cache, k, v, pos, logits, probs, step:
                        cache.append(k, v, pos))
    directory, _ = tiny_models["wide"]
    run = dataclasses.replace(on_gpu(batches=1))
    reference = cpu_reference(directory, run, tmp_path)
    out, _, _ = simulated_run(directory, run, tmp_path, monkeypatch)
    assert not torch.equal(reference.sequences, out.sequences)
