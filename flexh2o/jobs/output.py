"""A dataset job's output: JSONL records appended as they finish, and what a resumed job skips.

Each batch of finished records goes out in one write, flushed and fsynced: a reader tailing the file, or a
job killed at any moment, leaves at most one partial last line, which the next run drops and
redoes. Beside the output, `OUT.job.json` keeps the settings the records were made with and the
input's fingerprint (its size and a hash of its bytes); a resumed job with other settings or
another input is refused unless --overwrite starts the output again. A write that fails (a full
disk) is cut back to the records before it, so the output stays resumable (WriteFailed).
"""

import json
import os

from flexh2o.common.errors import UsageError
from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.common.output_files import check_output_file, write_json_atomic
from flexh2o.common.signals import deferred
from flexh2o.jobs.files import OutputLock, WriteFailed, open_for_append, write_lines_atomic


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
                record = parse_json(raw)
            except BadJson:
                break
            if not isinstance(record, dict) or record_id(record) is None:
                break
            records.append(record)
            good += len(raw)
    return records, good


def check_settings(path: str, settings: dict):
    """Refuses to add to the output at `path` records made with other settings than `settings`."""
    try:
        with open(settings_path(path), "rb") as f:
            saved = parse_json(f.read())
        if not isinstance(saved, dict):
            raise BadJson("is not a JSON object")
    except (OSError, BadJson):
        raise UsageError("--output", f"{path} exists and no job settings lie beside it "
                         f"({settings_path(path)}): not a flexh2o job's output; give --overwrite to "
                         "replace it") from None
    changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if "input_records" in changed:
        before, now = saved.get("input_records") or {}, settings.get("input_records") or {}
        raise UsageError("--input", f"{settings.get('input')} is not the input {path} was begun with ("
                         f"{before.get('size', '?')} bytes then, {now.get('size', '?')} now"
                         f"{', its records differ' if before.get('size') == now.get('size') else ''}): give "
                         f"--overwrite to start {path} afresh from this input, or give the original input")
    if changed:
        k = changed[0]
        raise UsageError("--output", f"{path} was made with {k}={saved.get(k)!r}, this run has "
                         f"{settings.get(k)!r}" + (f" (and {len(changed) - 1} more)" if len(changed) > 1
                                                   else "") + "; give --overwrite to start it again")


def write_in_order(path: str, by_id: dict, ids: list[str]) -> int:
    """path <- the records of `by_id` in the order of `ids`, written whole to a fresh temporary
    file and renamed into place; returns how many."""
    return write_lines_atomic(path, (json.dumps(by_id[rid], ensure_ascii=False) + "\n"
                                     for rid in ids if rid in by_id))


def write_settings(path: str, settings: dict):
    try:
        write_json_atomic(settings_path(path), settings)
    except OSError as e:
        raise WriteFailed(settings_path(path), e) from None


class JobOutput:
    writes = True

    def __init__(self, path: str, settings: dict, overwrite: bool = False, lock: OutputLock | None = None):
        """lock: the output's lock, taken by the caller (before it removed or merged anything);
        None: taken here."""
        self.path, self.settings, self.fd = path, settings, None
        check_output_file("--output", path)
        self.lock = lock or OutputLock(path)
        self.done: set[str] = set()
        try:
            if os.path.lexists(path) and not overwrite:
                self._resume()
            else:
                with deferred():
                    if os.path.lexists(path):
                        os.unlink(path)
                    self.fd = open_for_append(path, create=True)
                write_settings(path, settings)
        except BaseException:
            self.close()
            raise

    def _resume(self):
        check_settings(self.path, self.settings)
        self.fd = open_for_append(self.path, create=False)
        records, good = complete_records(self.path)
        if good < os.fstat(self.fd).st_size:
            self._cut(good)  # a record half-written by a kill is redone
        self.done = {record_id(r) for r in records}

    def _cut(self, size: int):
        try:
            os.ftruncate(self.fd, size)
        except OSError as e:
            raise WriteFailed(self.path, e) from None

    def append(self, records: list[dict]):
        """Writes the records as whole lines, in one write, and makes them durable. A signal waits
        until they are (and counted: the stop line says how many records are safe). A failed write
        is cut back to the records before it."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        with deferred():
            before = os.fstat(self.fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
                os.fsync(self.fd)
            except OSError as e:
                try:
                    os.ftruncate(self.fd, before)
                except OSError:
                    pass  # the next run drops a partial last line all the same
                raise WriteFailed(self.path, e) from None
            self.done.update(record_id(r) for r in records)

    def rewrite_in_order(self, ids: list[str]):
        """The output's records in the order of `ids` (input order), replaced atomically."""
        records, _ = complete_records(self.path)
        write_in_order(self.path, {record_id(r): r for r in records}, ids)
        with deferred():
            os.close(self.fd)
            self.fd = open_for_append(self.path, create=False)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
