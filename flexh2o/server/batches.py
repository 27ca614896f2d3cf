"""The Batch API: a batch is a dataset job whose records join the server's one pool of slots.

A batch's input file is read and checked by the job's own machinery (jobs/input.py: every record
checked and tokenized, only its index kept) on a thread of its own while the batch is
`validating`; a bad record goes to the batch's error file, as `--skip-bad` writes it. Then, while
`in_progress`, the engine loop takes its records (largest max_tokens first, as a job's) for the
rows online requests leave; each finished record is formatted and appended by the job's output
(jobs/output.py: whole lines, fsynced a batch of records at a time, resumable), in
batches/<id>/output.jsonl. When every record is written the output and error files become files
of the Files API (`finalizing`, then `completed`).

Everything a batch is lives in the state dir: batches/<id>.json (its OpenAI batch object, with the
ids its files will take), and its folder. A server killed at any point and started again on the
same state dir resumes each unfinished batch: the job's output skips the records already written
and redoes the rest, so every custom_id comes out exactly once, each as an uninterrupted run
writes it (greedy, or sampled from the record's seed or the server's --seed and its id).
"""

import collections
import json
import logging
import os
import re
import secrets
import threading
import time

from flexh2o.common.errors import UsageError
from flexh2o.common.json_data import parse_json
from flexh2o.common.output_files import write_json_atomic
from flexh2o.jobs.files import WriteFailed, write_lines_atomic
from flexh2o.jobs.format import OpenAIFormat
from flexh2o.jobs.input import JobInput
from flexh2o.jobs.job import FLUSH_SECONDS, record_request, result_record
from flexh2o.jobs.output import JobOutput
from flexh2o.server.engine_loop import Tag
from flexh2o.server.errors import ApiError, bad_request
from flexh2o.server.online import sampler_for

ID = re.compile(r"batch_[0-9a-f]{24}")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOW = "24h"
ENDED = ("failed", "completed", "expired", "cancelled")
FLUSH_RECORDS = 64  # finished records written at once (or after FLUSH_SECONDS)

log = logging.getLogger("flexh2o.serve")


STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *ENDED)


def batch_record_problem(record, batch_id: str) -> str | None:
    """What keeps a batch's saved object from being one this server wrote, or None: every field the
    server reads back is checked, so a file edited by hand is left aside, not a traceback later."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("id") != batch_id:
        return "its id is not its file's name"
    if record.get("status") not in STATUSES:
        return "no known status"
    if record.get("endpoint") not in ENDPOINTS:
        return "no known endpoint"
    if not all(isinstance(record.get(k), str) for k in ("input_file_id", "_output_file_id", "_error_file_id")):
        return "its file ids are not strings"
    if not isinstance(record.get("created_at"), int) or isinstance(record["created_at"], bool):
        return "created_at is not a time in seconds"
    counts = record.get("request_counts")
    if not isinstance(counts, dict) or not all(isinstance(v, int) for v in counts.values()):
        return "request_counts is not a table of counts"
    return None


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch {batch_id!r} on this server", "batch_id", "batch_not_found")


class Batch:
    """One batch: its object (as saved), and while it runs its records' feed for the engine loop."""

    def __init__(self, store, record: dict):
        self.store, self.record = store, record
        self.lock = threading.Lock()
        self.pending = collections.deque()  # entries to hand to the engine loop
        self.in_pool = set()                # its sequences in the engine loop
        self.finished = []                  # records formatted, not yet written
        self.last_write = time.monotonic()
        self.job_input = self.output = None
        self.ending = False

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def folder(self) -> str:
        return os.path.join(self.store.directory, self.id)

    def public(self) -> dict:
        return {k: v for k, v in self.record.items() if not k.startswith("_")}

    def save(self):
        write_json_atomic(os.path.join(self.store.directory, self.id + ".json"), self.record)

    def set_status(self, status: str, **fields):
        self.record.update(fields, status=status)
        self.record[f"{status}_at"] = int(time.time())
        self.save()

    # -- the engine loop's feed (engine thread) ------------------------------------------------------
    def has_work(self) -> bool:
        with self.lock:
            return self.record["status"] == "in_progress" and bool(self.pending)

    def next_request(self):
        with self.lock:  # (taken from pending and put in the pool at once: a cancel sees it in one of them)
            if self.record["status"] != "in_progress" or not self.pending:
                return None
            entry = self.pending.popleft()
            request = record_request(self.job_input, entry, self.store.tokenizer, self.store.seed,
                                     sampler=sampler_for(entry.sampling))
            request.tag = BatchRecord(self, *request.tag)
            self.in_pool.add(request)
        return request

    def record_done(self, request, tokens: list, reason: str):
        tag = request.tag
        with self.lock:
            self.in_pool.discard(request)
            if self.record["status"] == "failed":  # (its output could not be written: nothing more is)
                return
            if reason == "cancelled":
                if self.record["status"] == "in_progress":  # (the server stops: done at its next start)
                    self.pending.appendleft(tag.entry)
                ended = self.record["status"] == "cancelling" and not self.in_pool
            else:
                record, _ = result_record(self.store.formatter, self.store.engine_tokenizer, self.store.eos,
                                          tag.entry, tag.parsed, tokens)
                self.finished.append(record)
                ended = not self.pending and not self.in_pool
        if ended or len(self.finished) >= FLUSH_RECORDS or time.monotonic() - self.last_write >= FLUSH_SECONDS:
            self.flush()
        if ended:
            self.store.end(self)

    def flush(self):
        """Writes the records finished so far; a write that fails (a full disk) fails the batch, with
        what it wrote before kept."""
        with self.lock:
            records, self.finished = self.finished, []
        if records:
            try:
                self.output.append(records)
            except WriteFailed as e:
                self.store.fail(self, str(e))
        self.last_write = time.monotonic()

    def counts(self) -> dict:
        counts = dict(self.record["request_counts"])
        if self.output is not None:
            counts["completed"] = len(self.output.done)
        return counts


class BatchRecord(Tag):
    is_batch = True

    def __init__(self, batch: Batch, entry, parsed):
        super().__init__()
        self.batch, self.entry, self.parsed = batch, entry, parsed

    def done(self, request, tokens: list, reason: str):
        self.batch.record_done(request, tokens, reason)

    def fail(self, message: str):
        pass  # the engine failed: the server stops, and the batch resumes at its next start


class BatchStore:
    """Every batch of the state dir; new ones validated and run on `loop` (engine_loop.py)."""

    def __init__(self, directory: str, files, loop, tokenizers: tuple, eos, model: str, settings: dict,
                 max_model_len: int, seed: int):
        """tokenizers: the one shared by the threads that read inputs, and the engine thread's own
        (tokenizer.py); settings: what a batch's records depend on (model, its SHA-256, dtype, KV
        policy...): a batch begun with other settings is not resumed (jobs/output.py)."""
        self.directory, self.files, self.loop, self.eos = directory, files, loop, eos
        self.tokenizer, self.engine_tokenizer = tokenizers
        self.settings, self.max_model_len, self.seed = settings, max_model_len, seed
        self.formatter = OpenAIFormat(model)
        self.batches: dict[str, Batch] = {}
        self.lock = threading.Lock()
        self.threads = []

    # -- from the routes -----------------------------------------------------------------------------
    def create(self, body) -> dict:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be {' or '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        if window != WINDOW:
            raise bad_request(f"completion_window must be {WINDOW!r}, got {window!r}", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise bad_request("metadata must be an object of at most 16 string keys (64 characters) and string "
                              "values (512 characters)", "metadata")
        found = self.files.get(body.get("input_file_id"))
        if found.get("purpose") != "batch":
            raise bad_request(f"the file {found['id']} was not uploaded with purpose batch", "input_file_id")
        now = int(time.time())
        record = {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": endpoint, "errors": None,
                  "input_file_id": found["id"], "completion_window": WINDOW, "status": "validating",
                  "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                  "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                  "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                  "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                  "_output_file_id": "file-" + secrets.token_hex(12), "_error_file_id": "file-" + secrets.token_hex(12)}
        batch = Batch(self, record)
        os.mkdir(batch.folder)
        batch.save()
        with self.lock:
            self.batches[batch.id] = batch
        self._start(batch)
        return batch.public()

    def get(self, batch_id) -> Batch:
        with self.lock:
            batch = self.batches.get(batch_id) if isinstance(batch_id, str) and ID.fullmatch(batch_id) else None
        if batch is None:
            raise not_found(str(batch_id)[:100])
        return batch

    def view(self, batch: Batch) -> dict:
        return dict(batch.public(), request_counts=batch.counts())

    def list(self) -> list[Batch]:
        with self.lock:
            return sorted(self.batches.values(), key=lambda b: (-b.record["created_at"], b.id))

    def cancel(self, batch_id) -> dict:
        batch = self.get(batch_id)
        with batch.lock:
            status = batch.record["status"]
            if status in ENDED or status == "cancelling":
                raise ApiError(400, f"batch {batch.id} is {status}: it cannot be cancelled", "batch_id",
                               "batch_not_cancellable")
            batch.pending.clear()
            for request in batch.in_pool:
                request.cancelled = True
            idle = not batch.in_pool and status == "in_progress"
            batch.set_status("cancelling")
        self.loop.wake()
        if idle:
            self.end(batch)
        return self.view(batch)

    def uses(self, file_id: str) -> str | None:
        """The batch not yet ended whose input `file_id` is, if any."""
        return next((b.id for b in self.list() if b.record["input_file_id"] == file_id
                     and b.record["status"] not in ENDED), None)

    # -- resuming and running ------------------------------------------------------------------------
    def resume_all(self):
        """Every batch of the state dir: an unfinished one is validated again and goes on."""
        for name in sorted(os.listdir(self.directory)):
            if not (name.endswith(".json") and ID.fullmatch(name[:-5])):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:
                    record = parse_json(f.read())
                wrong = batch_record_problem(record, name[:-5])
                if wrong is not None:
                    raise ValueError(wrong)
            except (OSError, ValueError) as e:  # BadJson is a ValueError
                log.warning("warning: %s is not a batch flexh2o wrote (%s): left as it is", path, e)
                continue
            batch = Batch(self, record)
            self.batches[batch.id] = batch
            if record["status"] not in ENDED:
                self._start(batch)

    def _start(self, batch: Batch):
        thread = threading.Thread(target=self._validate, args=(batch,), name=f"flexh2o {batch.id}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _validate(self, batch: Batch):
        """Reads and checks the input, opens (or resumes) the output, and hands the batch to the loop."""
        try:
            path = self.files.content_path(batch.record["input_file_id"])
            chat = batch.record["endpoint"] == ENDPOINTS[0]
            defaults = {"max_tokens": None if chat else 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None}
            job_input = JobInput(path, self.tokenizer, defaults, self.max_model_len, skip_bad=True,
                                 urls=(batch.record["endpoint"],))
            if job_input.format != "openai":
                raise UsageError("input_file_id", "the file is not in the Batch API's format (each line "
                                 "{\"custom_id\", \"method\", \"url\", \"body\"})")
            bad = [self.formatter.error(e) for e in job_input.entries if e.error is not None]
            errors = os.path.join(batch.folder, "errors.jsonl")
            if bad and not os.path.exists(errors):
                write_lines_atomic(errors, (json.dumps(r, ensure_ascii=False) + "\n" for r in bad))
            output = JobOutput(os.path.join(batch.folder, "output.jsonl"),
                               {**self.settings, "input_records": job_input.fingerprint})
        except (UsageError, ApiError, WriteFailed, OSError) as e:
            batch.set_status("failed", errors={"object": "list", "data": [
                {"code": "invalid_file", "message": str(e), "param": None, "line": None}]})
            return
        good = sorted((e for e in job_input.entries if e.error is None and e.id not in output.done),
                      key=lambda e: (-e.max_tokens, e.number))
        with batch.lock:
            batch.job_input, batch.output = job_input, output
            batch.pending.extend(good)
            batch.record["request_counts"] = {"total": len(job_input.entries), "completed": len(output.done),
                                              "failed": len(bad)}
            if batch.record["status"] == "validating":
                batch.set_status("in_progress")
            status = batch.record["status"]
        if status in ("finalizing", "cancelling") or not good:
            self.end(batch)
            return
        self.loop.add_feed(batch)

    def end(self, batch: Batch):
        """The batch's last record is written (or it was cancelled): its files published. Made again
        from where it stopped after a restart (`finalizing`, `cancelling`)."""
        self.loop.remove_feed(batch)
        with batch.lock:
            if batch.ending or batch.record["status"] == "failed":
                return
            batch.ending = True
            cancelled = batch.record["status"] == "cancelling"
            if not cancelled and batch.record["status"] != "finalizing":
                batch.set_status("finalizing")
        if batch.output is not None:
            batch.flush()
            batch.record["request_counts"] = batch.counts()
            batch.output.close()
            if batch.record["status"] == "failed":  # (the last records could not be written)
                return
        fields = {}
        for key, name in (("output_file_id", "output.jsonl"), ("error_file_id", "errors.jsonl")):
            file_id = batch.record["_" + key]
            if self.files.publish_as(os.path.join(batch.folder, name), file_id, f"{batch.id}_{name}",
                                     "batch_output") is not None:
                fields[key] = file_id
        batch.set_status("cancelled" if cancelled else "completed", **fields)

    def fail(self, batch: Batch, message: str):
        """The batch cannot go on (its output cannot be written): failed, its records in flight dropped."""
        self.loop.remove_feed(batch)
        with batch.lock:
            batch.pending.clear()
            for request in batch.in_pool:
                request.cancelled = True
            batch.set_status("failed", errors={"object": "list", "data": [
                {"code": "output_failed", "message": message, "param": None, "line": None}]})
        log.error("error: batch %s failed: %s", batch.id, message)

    def close(self):
        """At the server's stop: the batches' finished records written, their outputs closed."""
        for batch in self.list():
            if batch.output is not None and batch.record["status"] not in ENDED:
                batch.flush()
                batch.output.close()
