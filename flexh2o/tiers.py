"""Where tensors live and how they reach the compute device.

The compute device is called "gpu" in flags and fields; it is the CPU itself when there is no
CUDA. In this version every tensor lives on the compute device, so loading is a no-op that hands
out the home tensor; the tier split of the Policy plugs in here without touching the layers.
"""

import torch


class Tiers:
    def __init__(self, device: str | torch.device, dtype: torch.dtype):
        self.compute = torch.device(device)
        self.dtype = dtype

    def place_weight(self, tensor: torch.Tensor) -> torch.Tensor:
        """Puts a weight at its home tier, in the run's dtype."""
        return tensor.to(device=self.compute, dtype=self.dtype)

    def load(self, home: torch.Tensor) -> torch.Tensor:
        """The compute-device copy of a tensor living at `home`."""
        return home

    def zeros(self, shape, dtype=None) -> torch.Tensor:
        """A zeroed buffer on the compute device (KV cache slots)."""
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.compute)

    def sync(self):
        if self.compute.type == "cuda":
            torch.cuda.synchronize(self.compute)
