"""The link between pipeline stages (pipeline.py): the bytes per second a hidden state crosses from
one process to another over torch.distributed's gloo, measured between two local processes (the
profile's `link_bandwidth`). Across machines the network sets it instead: a profile for such a
setup names its own figure, and `python -m flexh2o.plan --link-bandwidth` overrides it."""

import queue
import socket
import time

from flexh2o.common.errors import UsageError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(rank: int, port: int, nbytes: int, rounds: int, results):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    # A store of its own: under torchrun, a tcp:// rendezvous would look for torchrun's agent instead.
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    tensor = torch.ones(nbytes // 4)
    other = 1 - rank

    def bounce():  # there and back
        if rank == 0:
            dist.send(tensor, other)
            dist.recv(tensor, other)
        else:
            dist.recv(tensor, other)
            dist.send(tensor, other)
    bounce()  # the connection's set-up
    start = time.perf_counter()
    for _ in range(rounds):
        bounce()
    seconds = time.perf_counter() - start
    if rank == 0:
        results.put(2 * rounds * nbytes / seconds)
    dist.destroy_process_group()


def link_rate(quick: bool = False) -> float:
    """Bytes/s between two local processes, each sending a hidden-state-sized tensor and back."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    nbytes, rounds = (1 << 20, 4) if quick else (16 << 20, 16)
    port = _free_port()
    procs = [context.Process(target=_pair, args=(rank, port, nbytes, rounds, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        rate = results.get(timeout=120)
    except queue.Empty:
        raise UsageError("--link-bandwidth", "two local processes could not measure the link between them within "
                         "120 s: give the link's speed in GB/s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return rate
