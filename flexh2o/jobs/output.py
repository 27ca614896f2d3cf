"""A dataset job's output: JSONL records appended as they finish, and what a resumed job skips.

Each batch of finished records goes out in one write, flushed and fsynced: a reader tailing the file, or a
job killed at any moment, leaves at most one partial last line, which the next run drops and
redoes. Beside the output, `OUT.job.json` keeps the settings the records were made with and the
input's fingerprint (its size and a hash of its bytes); a resumed job with other settings or
another input is refused unless --overwrite starts the output again. The settings file is read as
data: one that is not a job's settings is one line naming it. A write that fails (a full disk) is
cut back to the records before it, so the output stays resumable (WriteFailed).
"""

import json
import os

from flexh2o.checkpoints.fingerprint import is_sha256
from flexh2o.common.arguments import shown
from flexh2o.common.errors import UsageError
from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.common.output_files import check_output_file, json_text
from flexh2o.common.signals import deferred
from flexh2o.jobs.files import OutputLock, WriteFailed, open_for_append, remove_left_temporary_files, \
    write_lines_atomic

MAX_SETTINGS = 1 << 20  # bytes: a job's settings take a few hundred
NOT_COMPARED = ("input",)  # the input's path: the same file under another spelling (or moved) resumes


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


JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "true or false", int: "a number",
              float: "a number", type(None): "null"}


def is_fingerprint(value) -> bool:
    """An input's fingerprint as JobInput takes it: {"size": bytes, "sha256": 64 hex digits}."""
    return isinstance(value, dict) and isinstance(value.get("size"), int) and not isinstance(value["size"], bool) \
        and is_sha256(value.get("sha256"))


def saved_settings(path: str) -> tuple[dict | None, str | None]:
    """(the settings saved beside the output at `path`, None), or (None, what is wrong with their file)."""
    try:
        with open(settings_path(path), "rb") as f:
            text = f.read(MAX_SETTINGS + 1)
    except FileNotFoundError:
        return None, "is missing"
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    if len(text) > MAX_SETTINGS:
        return None, f"is larger than {MAX_SETTINGS >> 20} MB, far beyond any job's settings"
    try:
        saved = parse_json(text)
    except BadJson as e:
        return None, str(e)
    if not isinstance(saved, dict):
        return None, f"holds {JSON_KINDS.get(type(saved), 'a JSON value')}, not a job's settings (an object)"
    if not isinstance(saved.get("model"), str) or not is_fingerprint(saved.get("input_records")):
        return None, "lacks what a job's settings hold (the model, the input's size and SHA-256)"
    return saved, None


def finished_count(n: int) -> str:
    return f"{n} finished record" + ("" if n == 1 else "s")


def check_settings(path: str, settings: dict, finished: int):
    """Refuses to add to the output at `path`, which holds `finished` whole records, records made
    with other settings than `settings`. Where records are finished, the way out it names keeps them."""
    saved, wrong = saved_settings(path)
    if wrong is not None:
        if finished:
            raise UsageError("--output", f"{settings_path(path)} {wrong}, so the {finished_count(finished)} in {path} "
                             "cannot be checked against this run: put back the settings file made with them, or give "
                             "another --output")
        raise UsageError("--output", f"{path} exists and its job settings {settings_path(path)} {wrong}: not a "
                         "flexh2o job's output; give --overwrite to replace it, or another --output")
    changed = sorted(k for k in (set(saved) | set(settings)) - set(NOT_COMPARED) if saved.get(k) != settings.get(k))
    if "input_records" in changed:
        before, now = saved["input_records"], settings["input_records"]
        what = (f"{settings.get('input')} is not the input {path} was begun with ({before['size']} bytes then, "
                f"{now['size']} now{', its records differ' if before['size'] == now['size'] else ''})")
        if finished:
            raise UsageError("--input", f"{what}: give the input it was begun with to go on from its "
                             f"{finished_count(finished)}, or give this input another --output")
        raise UsageError("--input", f"{what}: give --overwrite to start {path} afresh from this input (it holds no "
                         "finished record), or give the original input")
    if changed:
        k = changed[0]
        what = (f"{path} was made with {k}={shown(saved.get(k))}, this run has {shown(settings.get(k))}"
                + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""))
        if finished:
            raise UsageError("--output", f"{what}: run with the settings it was made with to go on from its "
                             f"{finished_count(finished)}, or give another --output")
        raise UsageError("--output", f"{what}; give --overwrite to start it again (it holds no finished record)")


def finished_records(path: str, settings: dict) -> list[dict]:
    """The whole records of the output at `path` that a run with `settings` resumes (none where
    there is no output), read without writing anything; a resume that cannot go on is refused."""
    if not os.path.lexists(path):
        return []
    records, _ = complete_records(path)
    check_settings(path, settings, len(records))
    return records


def write_in_order(path: str, by_id: dict, ids: list[str]) -> int:
    """path <- the records of `by_id` in the order of `ids`, written whole to a fresh temporary
    file and renamed into place; returns how many."""
    return write_lines_atomic(path, (json.dumps(by_id[rid], ensure_ascii=False) + "\n"
                                     for rid in ids if rid in by_id))


def write_settings(path: str, settings: dict):
    write_lines_atomic(settings_path(path), [json_text(settings)])


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
            remove_left_temporary_files([path, settings_path(path)])  # the lock is ours: no rewrite runs
            if os.path.lexists(path) and not overwrite:
                self._resume()
            else:
                with deferred():
                    if os.path.lexists(path):
                        os.unlink(path)
                # The settings first: a stop before the output exists leaves a job that starts afresh.
                write_settings(path, settings)
                with deferred():
                    self.fd = open_for_append(path, create=True)
        except BaseException:
            self.close()
            raise

    def _resume(self):
        records, good = complete_records(self.path)
        check_settings(self.path, self.settings, len(records))
        self.fd = open_for_append(self.path, create=False)
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
