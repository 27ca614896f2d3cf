"""A dataset job's output: JSONL records appended as blocks finish, and what a resumed job skips.

Each block's records go out in one write, flushed and fsynced: a reader tailing the file, or a
job killed at any moment, leaves at most one partial last line, which the next run drops and
redoes. Beside the output, `OUT.job.json` keeps the settings the records were made with; a
resumed job with other settings is refused unless --overwrite starts the output again.
"""

import json
import os

from ..errors import UsageError
from ..output import check_output_file, write_json_atomic
from ..signals import deferred


def settings_path(path: str) -> str:
    return path + ".job.json"


def record_id(record: dict) -> str | None:
    rid = record.get("custom_id", record.get("id"))
    return None if rid is None else str(rid)


def complete_records(path: str):
    """(records, bytes they take): the whole, parseable lines from the start of the file; the
    first partial or unreadable line ends them (a kill mid-write)."""
    records, good = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                record = json.loads(raw)
            except ValueError:
                break
            if not isinstance(record, dict) or record_id(record) is None:
                break
            records.append(record)
            good += len(raw)
    return records, good


def check_settings(path: str, settings: dict):
    """Refuses to add to the output at `path` records made with other settings than `settings`."""
    try:
        with open(settings_path(path), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        raise UsageError("--output", f"{path} exists and no job settings lie beside it "
                         f"({settings_path(path)}): not a flexh2o job's output; give --overwrite to "
                         "replace it") from None
    changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if changed:
        k = changed[0]
        raise UsageError("--output", f"{path} was made with {k}={saved.get(k)!r}, this run has "
                         f"{settings.get(k)!r}" + (f" (and {len(changed) - 1} more)" if len(changed) > 1
                                                   else "") + "; give --overwrite to start it again")


def write_in_order(path: str, by_id: dict, ids: list[str]) -> int:
    """path <- the records of `by_id` in the order of `ids`, written whole and renamed into place;
    returns how many."""
    tmp = path + ".ordered.tmp"
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rid in ids:
            if rid in by_id:
                f.write(json.dumps(by_id[rid], ensure_ascii=False) + "\n")
                written += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return written


class JobOutput:
    writes = True

    def __init__(self, path: str, settings: dict, overwrite: bool = False):
        self.path, self.settings = path, settings
        check_output_file("--output", path)
        self.done: set[str] = set()
        if os.path.exists(path) and not overwrite:
            self._resume()
        else:
            with open(path, "wb"):
                pass
            write_json_atomic(settings_path(path), settings)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def _resume(self):
        check_settings(self.path, self.settings)
        records, good = complete_records(self.path)
        if good < os.path.getsize(self.path):
            os.truncate(self.path, good)  # a record half-written by a kill is redone
        self.done = {record_id(r) for r in records}

    def append(self, records: list[dict]):
        """Writes the records as whole lines, in one write, and makes them durable. A signal waits
        until they are (and counted: the stop line says how many records are safe)."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        with deferred():
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
            self.done.update(record_id(r) for r in records)

    def rewrite_in_order(self, ids: list[str]):
        """The output's records in the order of `ids` (input order), replaced atomically."""
        records, _ = complete_records(self.path)
        write_in_order(self.path, {record_id(r): r for r in records}, ids)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
