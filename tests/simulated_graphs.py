"""CUDA graphs on the simulated device (simulated_cuda.py): a capture records ops, a replay re-runs them.

Its model of a graph: a capture records the aten ops run inside it, with the very tensors they
read and wrote; a replay runs those ops again on those tensors and nothing else. No Python code
runs at a replay, so whatever the program worked out on the host at capture time (an int that
picked a slot, a tensor made from host data) stays what it was then, as on a GPU, and shows as
wrong tokens. A capture leaves every tensor as it found it (a GPU runs nothing while capturing):
what its ops wrote is put back when it ends. Inside a capture, what CUDA forbids raises: a device
value read on the host (item, bool, tolist, nonzero, a copy to the host) and a copy from host
memory to the device.
"""

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {"item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__"}
NOT_PERMITTED = "operation not permitted when stream is capturing"


def tensors_in(x) -> list:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


class SimulatedGraph:
    def __init__(self, sim):
        self.sim, self.ops, self.replays = sim, None, 0

    def pool(self):
        return ("pool", id(self))

    def replay(self):
        assert self.ops is not None, "replay of a graph never captured"
        with self.sim.internal():
            for func, args, kwargs, outputs in self.ops:
                for recorded, new in zip(outputs, tensors_in(func(*args, **kwargs))):
                    if recorded.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
                        recorded.copy_(new)  # a new tensor then: the recorded one is what later ops read
        self.replays += 1


class _Recorder(TorchDispatchMode):
    """The aten ops of a capture, and the first contents of every storage they write."""

    def __init__(self):
        super().__init__()
        self.ops, self.saved = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(f"{func}: {NOT_PERMITTED}")
        for n, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[n] if n < len(args) else kwargs.get(arg.name)
                for t in tensors_in(value):
                    storage = t.untyped_storage()
                    self.saved.setdefault(storage.data_ptr(), (storage, storage.clone()))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, tensors_in(out)))
        return out

    def restore(self):
        for storage, first in self.saved.values():
            storage.copy_(first)


class _NoHost(TorchFunctionMode):
    """Raises on the torch calls a capture may not make."""

    def __init__(self, sim):
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")])
        from_host = name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and \
            not self.sim.is_device(args[1])
        if name in HOST_READS or to_host or from_host:
            raise RuntimeError(f"{name}: {NOT_PERMITTED}")
        return func(*args, **kwargs)


def install(sim, monkeypatch):
    """torch.cuda.CUDAGraph and torch.cuda.graph as simulated graphs of `sim`; sim.graphs lists them."""
    sim.graphs = []

    def new_graph(*_, **__):
        graph = SimulatedGraph(sim)
        sim.graphs.append(graph)
        return graph

    @contextmanager
    def graph(cuda_graph, pool=None, stream=None, **_):
        recorder, no_host = _Recorder(), _NoHost(sim)
        try:
            with recorder, no_host:
                yield cuda_graph
        finally:
            with sim.internal():
                recorder.restore()
        cuda_graph.ops = recorder.ops

    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
