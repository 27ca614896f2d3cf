"""The GPU's dequantizer (gpu_dequant.py): the torch path and the Triton kernel (in Triton's interpreter,
where Triton is installed) give quant.py's and gguf_blocks.py's values, and on the simulated CUDA
device a compressed weight homed in CPU memory moves as its pinned groups, one copy and one call
of the dequantizer per matrix, nothing dequantized on the host, the CPU run's tokens."""

import importlib
import math
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from flexh2o.compression import gguf_blocks, gpu_dequant, quant
from flexh2o.offload.tiers import Tiers
import simulated_cuda
from test_simulated_cuda import assert_same, cpu_reference, policy, simulated_run

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def blocks_of(fmt: str, rows: int, n: int, seed: int = 0) -> torch.Tensor:
    """Random rows of GGUF blocks whose scales (and minima) are ordinary float16 numbers."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, gguf_blocks.row_bytes(fmt, n)), dtype=torch.uint8, generator=g)
    record = data.view(rows, -1, gguf_blocks.BLOCK_BYTES[fmt])
    record[..., 0:2] = torch.rand(rows, record.shape[1], 1, generator=g).half().view(torch.uint8)
    if fmt == "Q4_1":
        record[..., 2:4] = torch.randn(rows, record.shape[1], 1, generator=g).half().view(torch.uint8)
    return data


def case(fmt: str, n: int, rows: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed rows in `fmt`, their values in float32 as quant.py or gguf_blocks.py's torch path gives them)."""
    if fmt == "groups":
        packed = quant.quantize(torch.randn(rows, n, generator=torch.Generator().manual_seed(n)) * 3)
        return packed, quant.dequantize_torch(packed, n)
    if fmt in gguf_blocks.SIXTEEN_BIT:
        values = torch.randn(rows, n).to(gguf_blocks.SIXTEEN_BIT[fmt])
        return values.view(torch.uint8).view(rows, -1), values.float()
    packed = blocks_of(fmt, rows, n)
    return packed, gguf_blocks._dequantize_torch(packed, fmt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,n", [("groups", 64), ("groups", 200), ("Q4_0", 128), ("Q4_1", 96), ("Q8_0", 64),
                                   ("F16", 64), ("BF16", 32)])
def test_the_torch_path_gives_the_reference_values(fmt, n, dtype):
    packed, expected = case(fmt, n)
    out = torch.full((len(packed), n), float("nan"), dtype=dtype)
    gpu_dequant.dequantize(packed, fmt, out, gpu_dequant.Workspace())
    assert torch.equal(out, expected.to(dtype))


def slot_major_window(slots: int, batch: int, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's first slots [batch, heads, slots, d] as kv/home.py loads them: permuted to slot-major."""
    cache = torch.zeros(batch, heads, slots + 3, d)
    return cache, cache[:, :, :slots].permute(2, 0, 1, 3)


def test_a_strided_output_in_blocks_smaller_than_a_row(monkeypatch):
    """A slot-major cache window (three leading dimensions, strided) and a block of fewer values than a
    row: the same values, the workspace made once and large enough for one index of the first dimension."""
    monkeypatch.setattr(gpu_dequant, "BLOCK_VALUES", 100)
    _, window = slot_major_window(5, 3, 2, 64)
    packed = quant.quantize(torch.randn(5, 3, 2, 64))
    workspace = gpu_dequant.Workspace(least=0)
    gpu_dequant.dequantize(packed, "groups", window, workspace)
    assert torch.equal(window, quant.dequantize_torch(packed, 64))
    assert workspace.made == 1 and workspace.values.numel() == 3 * 2 * 64


def test_outputs_it_cannot_write_are_refused():
    packed = quant.quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="cannot write"):
        gpu_dequant.dequantize(packed, "groups", torch.empty(64, 4).t())
    with pytest.raises(ValueError, match="do not hold"):
        gpu_dequant.dequantize(packed, "groups", torch.empty(5, 64))
    assert not gpu_dequant.takes(torch.empty(2, 2, 2, 2, 64).permute(3, 2, 1, 0, 4))  # four leading dimensions
    assert gpu_dequant.takes(torch.empty(2, 2, 2, 2, 64).permute(0, 1, 3, 2, 4))  # two of them merged


class Ops(TorchFunctionMode):
    """Records each op's name and the storages of the tensors it returns (views return their base's)."""

    def __init__(self):
        super().__init__()
        self.names, self.storages = [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(getattr(func, "__name__", str(func)))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.storages.add(t.untyped_storage().data_ptr())
        return out


def test_the_torch_path_allocates_nothing_after_its_first_call_and_writes_five_times_a_block():
    packed, _ = case("groups", 256, rows=8)
    out, workspace = torch.empty(8, 256, dtype=torch.float16), gpu_dequant.Workspace()
    gpu_dequant.dequantize(packed, "groups", out, workspace)
    with Ops() as ops:
        gpu_dequant.dequantize(packed, "groups", out, workspace)
    known = {t.untyped_storage().data_ptr() for t in (packed, out, workspace.codes, workspace.values)}
    assert ops.storages <= known
    writes = [name for name in ops.names if name in ("bitwise_and", "bitwise_right_shift", "copy_", "addcmul")]
    assert len(writes) == 5, ops.names


def test_without_triton_the_torch_path_is_said_once(monkeypatch, capsys):
    monkeypatch.setattr(gpu_dequant, "_KERNEL", [])
    monkeypatch.setitem(sys.modules, "flexh2o.compression.triton_dequant", None)  # its import fails
    assert gpu_dequant.kernel() is None and gpu_dequant.kernel() is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "Triton is not usable" in lines[0]


def test_a_kernel_that_fails_is_given_up_on_in_one_line(monkeypatch, capsys):
    class Failing:
        def launch(self, *args):
            raise RuntimeError("no such GPU")
    monkeypatch.setattr(gpu_dequant, "_KERNEL", [Failing()])
    packed, _ = case("groups", 64)
    out = torch.empty(len(packed), 64)
    assert not gpu_dequant.launched(gpu_dequant.kernel(), packed, gpu_dequant.LAYOUTS["groups"], out, len(packed),
                                    gpu_dequant.leading(out))
    assert gpu_dequant.kernel() is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "the Triton kernel failed (RuntimeError: no such GPU)" in lines[0]


def test_triton_turned_off_is_not_imported(monkeypatch):
    monkeypatch.setenv("FLEXH2O_TRITON", "0")
    monkeypatch.setattr(gpu_dequant, "_KERNEL", [])
    assert gpu_dequant.kernel() is None and gpu_dequant._KERNEL == []


@pytest.fixture
def interpreted(monkeypatch):
    """triton_dequant run by Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = importlib.import_module("flexh2o.compression.triton_dequant")
    return importlib.reload(module)  # jitted afresh, for the interpreter


def launch(triton_dequant, packed, fmt, out):
    sizes, strides = gpu_dequant.leading(out)
    triton_dequant.launch(packed.contiguous(), gpu_dequant.LAYOUTS[fmt], out, math.prod(out.shape[:-1]), sizes, strides)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,n", [("groups", 64), ("groups", 200), ("Q4_0", 128), ("Q4_1", 96), ("Q8_0", 64)])
def test_the_triton_kernel_gives_the_reference_values(interpreted, fmt, n, dtype):
    """Exact, as on a GPU, but for bfloat16: the interpreter narrows to it by truncating where a GPU
    rounds to nearest, so there it is held to one bfloat16 step."""
    packed, expected = case(fmt, n)
    out = launch(interpreted, packed, fmt, torch.full((len(packed), n), float("nan"), dtype=dtype))
    if dtype == torch.bfloat16:
        assert torch.allclose(out.float(), expected, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(out, expected.to(dtype))


def test_the_triton_kernel_writes_a_strided_cache_window(interpreted):
    cache, window = slot_major_window(5, 3, 2, 64)
    packed = quant.quantize(torch.randn(5, 3, 2, 64))
    launch(interpreted, packed, "groups", window)
    assert torch.equal(window, quant.dequantize_torch(packed, 64))
    assert (cache[:, :, 5:] == 0).all()


def test_compressed_weights_in_cpu_memory_move_as_pinned_groups_and_dequantize_on_the_device(
        tiny_models, tmp_path, monkeypatch):
    """On the simulated CUDA device: each load of a compressed matrix is one host-to-device copy, of its
    uint8 groups from pinned memory, and one call of the dequantizer, from the I/O thread, into device
    memory, left in flight (no I/O thread waits for the device); nothing is dequantized on the host; no
    allocation after the first steps; the CPU run's tokens."""
    directory, _ = tiny_models["wide"]
    run_policy = policy((0, 100), batches=2, compress_weight=True)
    reference = cpu_reference(directory, run_policy, tmp_path)
    seen = {"loads": 0, "moved": 0, "fused": [], "host": 0, "copies": [], "tiers": None, "io_waits": 0}

    def watch(simulated):
        load, to_device, fused = Tiers._load_compressed, Tiers.to_device, gpu_dequant.dequantize

        def counted_load(tiers, placed, whole):
            seen["loads"] += 1
            seen["moved"] += whole is None  # not held whole on the device (the LM head is)
            seen["tiers"] = tiers
            return load(tiers, placed, whole)

        def watched_copy(tiers, dst, src):
            seen["copies"].append((dst.dtype, dst.dim(), tiers.is_pinned(src)))
            return to_device(tiers, dst, src)

        def watched_fused(packed, fmt, out, workspace=None):
            io_thread = threading.current_thread() is not threading.main_thread()
            seen["fused"].append((io_thread, packed.dtype, simulated.is_device(packed), simulated.is_device(out)))
            return fused(packed, fmt, out, workspace)

        def watched_wait(event, _original=simulated_cuda.Event.synchronize):
            seen["io_waits"] += threading.current_thread() is not threading.main_thread()
            return _original(event)

        def on_the_host(*args, **kwargs):
            seen["host"] += 1
            raise AssertionError("dequantized outside gpu_dequant")
        monkeypatch.setattr(Tiers, "_load_compressed", counted_load)
        monkeypatch.setattr(Tiers, "to_device", watched_copy)
        monkeypatch.setattr(gpu_dequant, "dequantize", watched_fused)
        monkeypatch.setattr(simulated_cuda.Event, "synchronize", watched_wait)
        monkeypatch.setattr(quant, "dequantize", on_the_host)
        monkeypatch.setattr(gguf_blocks, "dequantize", on_the_host)
    out, stats, _ = simulated_run(directory, run_policy, tmp_path, monkeypatch, before=watch)
    assert_same(reference, out)
    assert stats.step_allocations[2:] == [0] * (len(stats.step_allocations) - 2)
    loads = seen["loads"]
    assert loads > 0 and seen["host"] == 0
    from_loads = [call[1:] for call in seen["fused"] if call[0]]
    assert from_loads == [(torch.uint8, True, True)] * loads
    # The rest: the embedding's rows looked up, on the compute thread, into device memory (they are
    # moved with .to(the compute device), which on the simulated device is the CPU: no copy).
    assert all(call[3] for call in seen["fused"])
    matrices = [copy for copy in seen["copies"] if copy[1] >= 2]
    assert seen["moved"] > 0 and matrices == [(torch.uint8, 2, True)] * seen["moved"]
    assert seen["tiers"].dequant_space.made == 1
    assert seen["io_waits"] == 0  # the I/O threads queue copies and kernels and never wait for the device


def test_the_benchmark_says_in_one_line_that_it_needs_cuda():
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_gpu_dequant.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0
    assert done.stdout.splitlines() == ["bench_gpu_dequant: no CUDA device here; nothing measured"]
