"""The CUDA-only layer under Tiers: copies on a side stream, pinned staging for disk reads.

Copies run on the I/O threads: each waits for the compute stream's work queued so far, copies on
its own stream, and blocks its thread (not the compute stream) until the copy is done, so the
Pending the schedule waits on means "the data is there".
"""

import torch


class CudaCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.staging: dict[int, list] = {}

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self.stream.synchronize()

    def copy_from_disk(self, disk, file, offset: int, out: torch.Tensor):
        nbytes = out.numel() * out.element_size()
        free = self.staging.setdefault(nbytes, [])
        stage = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        try:
            view = stage.view(out.dtype).view(out.shape)
            disk.read(file, offset, view)
            self.copy(out, view)
        finally:
            free.append(stage)
