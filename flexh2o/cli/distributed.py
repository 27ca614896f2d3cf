"""A `torchrun` world: where this process stands in it, and how its ranks learn of each other.

torchrun starts one process per rank and tells each where it stands through the environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The world is
stages x replicas: rank r is stage r % S of replica r // S, so a replica's stages are neighbouring
ranks (on one node when --nproc-per-node is a multiple of S). Without torchrun the world is one
process and nothing here runs.

The ranks share torch.distributed's key-value store (the one torchrun's rendezvous opens; no
transport of flexh2o's own). Through it they agree on the run's settings before any weight loads,
and no rank can hang on one that died: each beats a counter every second and, when it fails,
leaves its error line; a watcher thread on every rank reads them and stops its own rank (with
signals.stop_for, so it unwinds and removes its offload files) when another rank failed, or
another's beat stood still for --peer-timeout seconds, or the store itself is gone. Waiting for
other ranks is a poll of the store from Python, never a blocking call a stop could not cut short.
"""

import os
import socket
import threading
import time
from dataclasses import dataclass

from flexh2o.common.errors import UsageError

BEAT_SECONDS = 1.0  # how often a rank beats, and its watcher looks at the others
POLL_SECONDS = 0.05  # how often a wait for other ranks looks at the store


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # processes on this node
    stages: int = 1

    @property
    def replicas(self) -> int:
        return self.size // self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size} (replica {self.replica + 1} of {self.replicas})"


def world_from_env(stages: int, env=os.environ) -> World:
    """This process's place in the world torchrun described; a world of one without torchrun.
    Checked on every rank alike, before any rank waits for another."""
    if stages < 1:
        raise UsageError("--pipeline-stages", f"must be a positive integer, got {stages}")
    if "WORLD_SIZE" not in env:
        if stages > 1:
            raise UsageError("--pipeline-stages", f"{stages} stages need {stages} processes or a multiple: start "
                             f"the run with torchrun --nproc-per-node {stages} -m flexh2o.run ...")
        return World()
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_rank, local_size = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    except (KeyError, ValueError):
        raise UsageError("--pipeline-stages", "WORLD_SIZE is set but RANK is not a number: start the run with "
                         "torchrun, which sets both") from None
    if size % stages:
        raise UsageError("--pipeline-stages", f"{stages} does not divide the world of {size} processes: give a "
                         f"divisor of {size}, or start a multiple of {stages} processes")
    return World(rank, size, local_rank, local_size, stages)


def open_store(world: World, timeout: float):
    """The world's store, as torchrun's rendezvous opened it (its agent's, or rank 0's): the
    process group's (pipeline.py) and, under a prefix, the ranks' own keys."""
    import datetime

    import torch.distributed as dist
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    except (RuntimeError, ValueError) as e:
        raise UsageError("--peer-timeout", f"the ranks could not meet at {os.environ.get('MASTER_ADDR')}:"
                         f"{os.environ.get('MASTER_PORT')} within {timeout:g} s: {str(e).splitlines()[0]}") from None
    return store


class Peers:
    """This rank's view of the others, through the store: agreement, failure, waiting."""

    def __init__(self, world: World, store, timeout: float, stop):
        """store: the world's (open_store); stop(reason): what the watcher calls when another rank
        failed (signals.stop_for)."""
        import torch.distributed as dist
        self.world, self.base, self.timeout, self._stop = world, store, timeout, stop
        self.store = dist.PrefixStore("flexh2o", store)
        self._closed = threading.Event()
        self._beats = {r: (-1, time.monotonic()) for r in range(world.size) if r != world.rank}
        self._watcher = threading.Thread(target=self._watch, name="flexh2o-peers", daemon=True)

    @classmethod
    def join(cls, world: World, timeout: float, stop) -> "Peers":
        peers = cls(world, open_store(world, timeout), timeout, stop)
        peers._beat()
        peers._watcher.start()
        return peers

    def agree(self, settings: dict):
        """Refuses, on every rank alike, a world whose ranks were given different settings (device
        type, dtype, model, ...): each publishes its own and compares the others' with them."""
        import json
        self.store.set(f"settings/{self.world.rank}", json.dumps(settings, sort_keys=True))
        theirs = [json.loads(v) for v in self.gather("settings")]
        for rank, other in enumerate(theirs):
            for key in settings:
                if other.get(key) != theirs[0].get(key):
                    flag, what = ("--model", "model files whose SHA-256 is ") if key == "model_sha256" else \
                        (f"--{key.replace('_', '-')}", "")
                    raise UsageError(flag, f"rank {rank} runs with {what}{other.get(key)!r}, rank 0 with "
                                     f"{what}{theirs[0].get(key)!r}: every rank must run with the same")

    def gather(self, prefix: str) -> list[str]:
        """The value every rank set under `prefix/rank`, waiting for the missing ones."""
        keys = [f"{prefix}/{r}" for r in range(self.world.size)]
        self.wait_for(keys)
        return [self.store.get(k).decode() for k in keys]

    def wait_for(self, keys: list[str]):
        """Polls until every key is set; a stop (another rank failed) ends the wait."""
        while not self.store.check(keys):
            time.sleep(POLL_SECONDS)

    def first_on_node(self, name: str, work):
        """work() on this node's local rank 0 first, then on the others (which wait for it): e.g.
        measuring the machine once, its profile then read from the cache by the rest."""
        key = f"node/{socket.gethostname()}/{name}"
        if self.world.local_rank == 0:
            result = work()
            self.store.set(key, "1")
            return result
        self.wait_for([key])
        return work()

    def finished(self):
        """This rank is done and may exit: its beat stops without alarming the others (nor they it)."""
        self.store.set(f"finished/{self.world.rank}", "1")
        if self.world.rank != 0:  # rank 0 still waits for the rest, watching them
            self.close()

    def wait_all_finished(self):
        self.wait_for([f"finished/{r}" for r in range(self.world.size)])

    def fail(self, line: str):
        """Tells every other rank that this one failed, with its error line."""
        try:
            self.store.set(f"failed/{self.world.rank}", line)
            self.store.add("failures", 1)
        except RuntimeError:  # the store is gone too: the others notice its loss themselves
            pass

    def close(self):
        """Stops watching; on rank 0, whose process may host the store (without torchrun's agent),
        first waits up to --peer-timeout for the others to be done with it."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join()
        try:
            self.store.set(f"closed/{self.world.rank}", "1")
            if self.world.rank == 0:
                deadline = time.monotonic() + self.timeout
                keys = [f"closed/{r}" for r in range(1, self.world.size)]
                while not self.store.check(keys) and time.monotonic() < deadline:
                    time.sleep(POLL_SECONDS)
        except RuntimeError:  # the store is gone: nothing left to wait for
            pass

    def _beat(self):
        self.store.add(f"beat/{self.world.rank}", 1)

    def _watch(self):
        while not self._closed.wait(BEAT_SECONDS):
            try:
                self._beat()
                reason = self._failure()
            except RuntimeError as e:  # the store's host is gone: rank 0, or torchrun's agent
                reason = (f"the ranks' store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} is "
                          f"gone ({str(e).splitlines()[0][:120]}): its host (rank 0 or torchrun) died")
            if reason is not None and not self._closed.is_set():
                self._stop(reason)
                return

    def _failure(self) -> str | None:
        """Why this rank must stop, or None: another rank's error, or its silence."""
        if int(self.store.add("failures", 0)) > 0:
            for r in self._beats:
                if self.store.check([f"failed/{r}"]):
                    return f"rank {r} failed: {self.store.get(f'failed/{r}').decode()}"
        now = time.monotonic()
        for r, (count, since) in list(self._beats.items()):
            if self.store.check([f"finished/{r}"]):
                del self._beats[r]
                continue
            beats = int(self.store.add(f"beat/{r}", 0))
            if beats != count:
                self._beats[r] = (beats, now)
            elif now - since > self.timeout:
                return f"rank {r} gave no sign of life for {self.timeout:g} s (--peer-timeout): it died or hangs"
        return None
