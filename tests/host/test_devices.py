"""The default dtype: float32 on every kind of CPU, so that a record's text does not depend on its
batch; bfloat16 only when asked for (host/devices.py)."""

import pytest
import torch

from flexh2o.host import machine
from flexh2o.host.devices import default_dtype, parse_dtype


@pytest.mark.parametrize("native_bf16", [True, False])
def test_the_default_on_a_cpu_is_float32_whatever_it_computes_fastest(monkeypatch, native_bf16):
    monkeypatch.setattr(machine, "cpu_has_native_bf16", lambda: native_bf16)
    assert machine.cpu_compute_dtype() == (torch.bfloat16 if native_bf16 else torch.float32)
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.float16
    assert parse_dtype("bfloat16") == torch.bfloat16  # still there for whoever asks
