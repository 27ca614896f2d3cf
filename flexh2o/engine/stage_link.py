"""The link between pipeline stages (pipeline.py): point-to-point sends and receives over the
world's process group (gloo), and waits that another rank's failure can cut short.

gloo's receive is only known to be complete once waited for, and a wait cannot be given up
without breaking the connection. So a helper thread does the blocking wait, and the main thread
waits for it in slices that a signal interrupts: distributed.py's watcher stops a stage blocked on
a receive from a dead or failed rank. A connection that breaks (its peer died) raises LinkError,
one line naming the rank.
"""

import queue
import threading

import torch

WAIT_SLICE_SECONDS = 1.0
RAW_16 = (torch.bfloat16, torch.float16)  # sent as their 16 bits (gloo's types)


class LinkError(RuntimeError):
    pass


def broken(error: RuntimeError, rank: int) -> LinkError:
    """gloo's "[file:line] Read error ...: Connection reset by peer. ..." as one line naming the rank."""
    reason = str(error).splitlines()[0].rsplit("] ", 1)[-1].split(". ")[0][:160]
    return LinkError(f"rank {rank} is gone: the link to it broke ({reason})")


class Waiter:
    """Daemon threads that run blocking calls (a receive's wait) for a caller that waits on them in
    slices a signal can interrupt; daemons, so that a call left blocked by a dead peer does not keep
    the process from exiting."""

    def __init__(self, threads: int):
        self._jobs = queue.SimpleQueue()
        for n in range(threads):
            threading.Thread(target=self._serve, name=f"flexh2o-link-{n}", daemon=True).start()

    def _serve(self):
        while True:
            job = self._jobs.get()
            try:
                job.fn()
            except BaseException as e:  # handed to the caller
                job.error = e
            job.done.set()

    def submit(self, fn) -> "Call":
        call = Call(fn)
        self._jobs.put(call)
        return call


class Call:
    def __init__(self, fn):
        self.fn, self.done, self.error = fn, threading.Event(), None

    def result(self, source: int | None):
        """fn's outcome; a RuntimeError of the link with rank `source` (None: raised as it is) as a LinkError."""
        while not self.done.wait(WAIT_SLICE_SECONDS):
            pass
        if isinstance(self.error, RuntimeError) and source is not None:
            raise broken(self.error, source) from None
        if self.error is not None:
            raise self.error


def run_interruptibly(fn):
    """fn() on a daemon thread, waited for in slices a signal can interrupt."""
    Waiter(1).submit(fn).result(None)


class Received:
    """A posted receive: wait() gives its tensor once it has come."""

    def __init__(self, call: Call, tensor, source: int):
        self.call, self.tensor, self.source = call, tensor, source

    def wait(self) -> torch.Tensor:
        self.call.result(self.source)
        return self.tensor


class Link:
    """Point-to-point sends and receives over the default process group."""

    def __init__(self):
        self._waiter = Waiter(4)
        self._sends = []

    def send(self, tensor: torch.Tensor, to: int, tag: int):
        import torch.distributed as dist
        tensor = tensor.detach().cpu().contiguous()
        wire = tensor.view(torch.int16) if tensor.dtype in RAW_16 else tensor  # gloo's types
        try:
            self._sends.append((dist.isend(wire, to, tag=tag), wire, to))
        except RuntimeError as e:
            raise broken(e, to) from None
        if len(self._sends) > 64:
            self._settle_sends(keep=32)

    def recv(self, shape, dtype, source: int, tag: int) -> Received:
        import torch.distributed as dist
        tensor = torch.empty(shape, dtype=dtype)
        try:
            work = dist.irecv(tensor.view(torch.int16) if dtype in RAW_16 else tensor, source, tag=tag)
        except RuntimeError as e:
            raise broken(e, source) from None
        return Received(self._waiter.submit(work.wait), tensor, source)

    def _settle_sends(self, keep: int = 0):
        """Waits for all but the last `keep` sends (gloo's sends complete once written out)."""
        done, self._sends = self._sends[:len(self._sends) - keep], self._sends[len(self._sends) - keep:]
        for work, _, to in done:
            self._waiter.submit(work.wait).result(to)

    def close(self):
        self._settle_sends()
