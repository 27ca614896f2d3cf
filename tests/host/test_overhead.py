"""The process's own memory: growth calibrated per dtype and thread count (or the default, saying
why), loading's transient counted by the pre-flight and held to by the loader, dirty pages flushed a
window at a time under a memory limit, and a pre-flight that does not import torch._dynamo."""

import json
import math
import subprocess
import sys
import tempfile

import pytest
import torch

from flexh2o.offload import disk
from flexh2o.offload.disk import DiskStore
from flexh2o.common.errors import UsageError
from flexh2o.engine.preflight import load_transient, stored_shapes
from flexh2o.models.opt import PRESETS
from flexh2o.host.hardware import from_dict
from flexh2o.host.process_memory import DEFAULT_GROWTH, DIRTY_WINDOW, FLOOR, MARGIN, process_growth
from flexh2o.engine.policy import Policy
from flexh2o.compression.quant import BLOCK_VALUES, check_quantizable
from flexh2o.checkpoints.weights import CheckpointWeights
from conftest import REPO, TEST_CPU_PROFILE

MB = 1 << 20


def test_the_growth_is_the_calibration_with_its_margin_or_the_default_saying_why():
    dirty = 3 * DIRTY_WINDOW
    assert process_growth(None, "float32", 2).bytes == DEFAULT_GROWTH + dirty
    assert "no local profile" in process_growth(None, "float32", 2).source
    measured = from_dict({**TEST_CPU_PROFILE, "process_growth": {"float32": {"2": 100 * MB}}}, "test")
    growth = process_growth(measured, "float32", 2)
    assert growth.bytes == int(100 * MB * MARGIN) + dirty and "calibrated for float32, 2 threads" in growth.source
    small = from_dict({**TEST_CPU_PROFILE, "process_growth": {"float32": {"2": 0}}}, "test")
    assert process_growth(small, "float32", 2).bytes == FLOOR + dirty
    for dtype, threads in (("bfloat16", 2), ("float32", 4)):  # not calibrated for these: the default, and why
        other = process_growth(measured, dtype, threads)
        assert other.bytes == DEFAULT_GROWTH + dirty and f"no calibration for {dtype}, {threads} threads" in other.source
    # Fewer threads than calibrated (a torchrun world's one per process): the fewest more bound it.
    several = from_dict({**TEST_CPU_PROFILE, "process_growth": {"float32": {"2": 100 * MB, "4": 300 * MB}}}, "test")
    one = process_growth(several, "float32", 1)
    assert one.bytes == int(100 * MB * MARGIN) + dirty and "calibrated for float32, 2 threads" in one.source
    assert process_growth(several, "float32", 3).bytes == int(300 * MB * MARGIN) + dirty


@pytest.mark.parametrize("bad", [[1], {"float32": {"two": 5}}, {"float32": {"2": -1}}, {"float32": 7}])
def test_a_bad_process_growth_in_a_profile_is_refused_naming_it(bad):
    with pytest.raises(UsageError, match="process_growth"):
        from_dict({**TEST_CPU_PROFILE, "process_growth": bad}, "test")


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_a_probe_grows_less_than_the_default_allows(tmp_path):
    """A probe's peak beyond its projection (loading's transient and the run's) is what calibration
    measures: well under the default growth, else the default is no upper bound."""
    r = subprocess.run([sys.executable, "-m", "flexh2o.cli.memory_probe", "--threads", "1", "--offload-dir", str(tmp_path),
                        "--probe", "compressed, on disk"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert 0 <= json.loads(r.stdout.splitlines()[-1])["growth_bytes"] < DEFAULT_GROWTH // 2


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_freed_prompt_caches_go_back_to_the_system():
    """The probe where glibc's moving mmap threshold kept one gpu-batch's prompt K and V per layer
    (205-293 MB beyond the projection at 12 layers) grows by less than the floor (malloc.py)."""
    code = ("import torch, flexh2o.cli.memory_probe as o; torch.set_num_threads(2); "
            "o.PROBE_CONFIG['num_hidden_layers'] = 12; o.PROBE_BATCH = 48; "
            "o.PROBES['x'] = dict(w=(0, 0), cache=(90, 0), num_gpu_batches=4, kv_policy='h2o', hh_ratio=0.2); "
            "import sys; r = o.probe('x', 'float32', sys.argv[1]); print(r['smaller'], r['growth_bytes'])")
    with tempfile.TemporaryDirectory() as offload:
        r = subprocess.run([sys.executable, "-c", code, offload], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    smaller, growth = r.stdout.split()[-2:]
    assert smaller == "False" and int(growth) < FLOOR  # the probe as asked for, not one sized down


def test_loading_counts_the_largest_layer_as_read_and_what_prepare_makes():
    spec = PRESETS["opt-125m"]
    layers = spec.build_layers()
    plain = load_transient(layers, 4, Policy())
    embedding = spec.vocab_size * spec.hidden_size * 4  # the input embedding (plus positions) or the head
    assert embedding <= plain <= embedding + (spec.max_positions + 2) * spec.hidden_size * 4
    compressed = load_transient(layers, 4, Policy(compress_weight=True))
    assert compressed > plain  # the groups beside the tensor, and a block's temporaries
    attention = layers[1]
    shapes = [tuple(s) for _, s in attention.weight_specs()]
    made = [s for s, _, _ in stored_shapes(attention, 4, Policy()) if s not in shapes]
    assert made == [(3 * spec.hidden_size, spec.hidden_size), (3 * spec.hidden_size,)]  # the fused q/k/v


def test_the_pre_flight_does_not_import_torch_dynamo():
    """Shapes are joined as shapes: meta tensors' cat would import torch._dynamo (75 MB) after the
    free memory was read."""
    code = ("import sys, torch; from flexh2o.engine.preflight import weight_need; from flexh2o.models.opt import PRESETS; "
            "from flexh2o.engine.policy import Policy; "
            "weight_need(PRESETS['opt-125m'].build_layers(), 4, Policy(w_gpu_percent=0), torch.device('cpu')); "
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr


def test_quantizability_is_checked_block_by_block_to_the_end():
    x = torch.zeros(3 * BLOCK_VALUES // 1024, 1024)
    check_quantizable(x)
    x[-1, -1] = math.inf
    with pytest.raises(ValueError, match="inf or NaN"):
        check_quantizable(x)
    x[-1, -1] = 1e6
    with pytest.raises(ValueError, match="float16's range"):
        check_quantizable(x)


def test_a_safetensors_weight_in_another_width_is_converted_by_rows(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    w = torch.randn(300, 40, dtype=torch.float16)
    save_file({"model.decoder.embed_tokens.weight": w}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr("flexh2o.checkpoints.weights.CONVERT_BYTES", 7 * 40 * 4)  # 7 rows at a time
    source = CheckpointWeights(str(tmp_path))
    got = source.get("decoder.embed_tokens.weight", (300, 40), torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, w.float())
    assert source.get("decoder.embed_tokens.weight", (300, 40), torch.float16).dtype == torch.float16


def test_under_a_memory_limit_writes_are_flushed_a_window_at_a_time(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(disk.os, "fdatasync", lambda fd: synced.append(fd))
    monkeypatch.setattr(disk, "DIRTY_WINDOW", 64 * 1024)
    store = DiskStore(str(tmp_path), flush_writes=True)
    try:
        big = torch.arange(5 * 64 * 1024 // 4, dtype=torch.float32)  # 5 windows
        f = store.create(big.numel() * 4)
        store.write(f, 0, big)
        assert len(synced) == 5
        rows = store.create(64 * 1024 * 2)
        row = torch.ones(1, 16 * 1024, dtype=torch.float32)  # one window a row
        synced.clear()
        store.write_rows(rows, torch.tensor([0]), row)
        assert synced == [rows.fd]  # a window written: flushed
        out = torch.empty(5 * 64 * 1024 // 4)
        store.read(f, 0, out)
        assert torch.equal(out, big)
    finally:
        store.close()


def test_without_a_limit_buffered_writes_are_not_flushed(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(disk.os, "fdatasync", lambda fd: synced.append(fd))
    store = DiskStore(str(tmp_path))
    try:
        f = store.create(4 * DIRTY_WINDOW)
        store.write(f, 0, torch.zeros(DIRTY_WINDOW, dtype=torch.float32))
        assert synced == []
    finally:
        store.close()


def test_the_report_shows_the_growth_and_its_source(tmp_path, capsys):
    from flexh2o.run import main
    out = tmp_path / "r.json"
    assert main(["--prompt-len", "16", "--gen-len", "2", "--gpu-batch-size", "2", "--dtype", "float32",
                 "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["process_growth_allowed_bytes"] > 0 and report["process_growth_source"]
    assert report["load_transient_bytes"] == load_transient(PRESETS["opt-125m"].build_layers(), 4, Policy())
    assert f"({report['process_growth_source']})" in capsys.readouterr().out
