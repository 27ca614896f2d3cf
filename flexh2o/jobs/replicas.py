"""A dataset job over data-parallel replicas (distributed.py): each replica generates its share of
the records into its own part of the output; rank 0 merges the parts into --output once every
replica has finished.

Records are dealt by length: sorted by prompt tokens (then input position), the i-th goes to
replica i % R, so every replica gets blocks of the same shapes and they finish together. A
replica writes its part (OUT.parts/replica-N.jsonl) exactly as one process writes --output
(output.py): block by block, fsynced, resumable. A run skips the records found in --output or in
any part, whoever wrote them, so a re-run (with any number of replicas, or none) finishes only
what is missing. The merge writes --output in input order, atomically, then removes the parts: a
kill between the two leaves records in both, which the next run reads once. On several nodes the
output must lie on a filesystem they share: rank 0 checks that it sees every part before any
weight loads.
"""

import os
import shutil

from flexh2o.common.errors import UsageError
from flexh2o.common.signals import deferred
from flexh2o.jobs.files import remove_left_temporary_files
from flexh2o.jobs.output import JobOutput, check_settings, complete_records, record_id, settings_path, write_in_order, \
    write_settings


def parts_dir(output: str) -> str:
    return output + ".parts"


def part_path(output: str, replica: int) -> str:
    return os.path.join(parts_dir(output), f"replica-{replica}.jsonl")


def part_paths(output: str) -> list[str]:
    folder = parts_dir(output)
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".jsonl"))


def deal(entries: list, replicas: int, replica: int) -> list:
    """This replica's records, in input order: every replicas-th of them sorted by length."""
    by_length = sorted(entries, key=lambda e: (e.prompt_tokens, e.number))
    return sorted(by_length[replica::replicas], key=lambda e: e.number)


def records_in(paths: list[str], settings: dict) -> dict:
    """id -> record of every whole record in the outputs at `paths` (each made with `settings`)."""
    found = {}
    for path in paths:
        if os.path.exists(path) and os.path.getsize(path) > 0:  # a part just opened may lack its settings yet
            records = complete_records(path)[0]
            check_settings(path, settings, len(records))
            for record in records:
                found.setdefault(record_id(record), record)
    return found


def start_over(output: str):
    """--overwrite: the output, its settings and every part removed (rank 0, before any part opens)."""
    with deferred():
        for path in (output, settings_path(output)):
            if os.path.exists(path):
                os.remove(path)
        shutil.rmtree(parts_dir(output), ignore_errors=True)


def merge(output: str, settings: dict, ids_in_order: list[str]) -> int:
    """--output <- its records and every part's, in input order, written whole and renamed into
    place; then the parts removed. Returns how many records it holds."""
    found = records_in([output] + part_paths(output), settings)
    with deferred():
        remove_left_temporary_files([output, settings_path(output)])  # a merge or rewrite a SIGKILL stopped
        write_settings(output, settings)
        written = write_in_order(output, found, ids_in_order)
        shutil.rmtree(parts_dir(output), ignore_errors=True)
    return written


class Unwritten:
    """The output of a pipeline stage that holds no tokens to write: what is done, nothing written."""
    writes = False

    def __init__(self, path: str):
        self.path, self.done = path, set()

    def append(self, records: list[dict]):
        self.done.update(record_id(r) for r in records)

    def rewrite_in_order(self, ids: list[str]):
        pass

    def close(self):
        pass


class Replica:
    """A dataset job's side of one data-parallel replica: its records, its part of the output, and
    the merge (on rank 0). peers: distributed.Peers of the world."""

    def __init__(self, peers, output: str, stage=None):
        """stage: this rank's pipeline stage (pipeline.py), or None: the whole model."""
        self.peers, self.world, self.output, self.stage = peers, peers.world, output, stage

    def open_output(self, settings: dict, overwrite: bool, all_ids: list[str]) -> JobOutput:
        """This replica's part, its `done` holding every record already made anywhere."""
        if overwrite and self.world.rank == 0:
            start_over(self.output)
        if overwrite:
            self.peers.store.set(f"cleared/{self.world.rank}", "1")
            self.peers.wait_for(["cleared/0"])
        os.makedirs(parts_dir(self.output), exist_ok=True)
        own = part_path(self.output, self.world.replica)
        if self.stage is None or self.stage.is_first:
            part = JobOutput(own, settings)
        else:  # the replica's first stage writes its records; the others run the same blocks
            part = Unwritten(own)
        others = [self.output] + [p for p in part_paths(self.output) if p != own or not part.writes]
        part.done |= set(records_in(others, settings))
        self.peers.store.set(f"opened/{self.world.rank}", "1")
        if self.world.rank == 0:
            self.peers.wait_for([f"opened/{r}" for r in range(self.world.size)])
            for replica in range(self.world.replicas):
                if not os.path.exists(part_path(self.output, replica)):
                    raise UsageError("--output", f"replica {replica}'s part {part_path(self.output, replica)} is "
                                     "not visible to rank 0: on several nodes, --output must lie on a filesystem "
                                     "every node shares")
        self.all_ids = all_ids
        return part

    def own(self, entries: list) -> list:
        return deal(entries, self.world.replicas, self.world.replica)

    def finish(self, settings: dict) -> str | None:
        """This replica is done; rank 0 waits for the others and merges. Returns rank 0's line."""
        self.peers.finished()
        if self.world.rank != 0:
            return None
        self.peers.wait_all_finished()
        n = merge(self.output, settings, self.all_ids)
        return f"merged: {n} of {len(self.all_ids)} records from {self.world.replicas} replicas in {self.output}"
