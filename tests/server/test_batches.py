"""The Files and Batch APIs through the openai client: a batch runs beside online requests, writes
every custom_id once (a bad record to the error file), can be cancelled, and survives a SIGKILL
of the server: started again on the same state dir, it finishes with what an uninterrupted run
writes."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from serving import POSITIONS, server, word_llama  # noqa: F401 - fixtures
from test_openai_client import PROMPTS, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def batch_lines(n: int, max_tokens=lambda k: 3 + k % 7, bad: tuple = ()) -> bytes:
    lines = []
    for k in range(n):
        if k % 2:
            body = {"messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}], "max_tokens": max_tokens(k),
                    "temperature": 0}
        else:
            body = {"messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
                    "max_completion_tokens": max_tokens(k), "temperature": 0.8, "seed": k}
        lines.append({"custom_id": f"req-{k}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    for k in bad:
        lines[k]["body"]["max_tokens"] = POSITIONS  # more than a sequence holds with its prompt
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def finished(client, batch_id: str, seconds: float = 120):
    deadline = time.monotonic() + seconds
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {seconds} s"
        time.sleep(0.05)


def outputs(client, file_id: str) -> dict:
    return {r["custom_id"]: r for r in map(json.loads, client.files.content(file_id).text.splitlines())}


def answers(records: dict) -> dict:
    return {k: (r["response"]["body"]["choices"][0]["message"]["content"], r["response"]["body"]["usage"])
            for k, r in records.items()}


def test_a_batch_runs_beside_online_requests_and_writes_each_record_once(server):
    client = server.client()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_lines(24, bad=(5,)))), purpose="batch")
    assert uploaded.purpose == "batch" and client.files.retrieve(uploaded.id).bytes == uploaded.bytes
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"kind": "test"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"kind": "test"}
    online = client.chat.completions.create(model=server.service.state.ctx.model, messages=[
        {"role": "user", "content": PROMPTS[1]}], max_tokens=4, temperature=0)
    done = finished(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (24, 23, 1)
    records = outputs(client, done.output_file_id)
    assert sorted(records) == sorted(f"req-{k}" for k in range(24) if k != 5)
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in records.values())
    (error,) = outputs(client, done.error_file_id).values()
    assert error["response"] is None and "max_tokens" in error["error"]["message"]
    assert records["req-1"]["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
    assert done.id in [b.id for b in client.batches.list().data]
    again = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert answers(outputs(client, finished(client, again.id).output_file_id)) == answers(records)


def test_a_cancelled_batch_ends_with_what_it_wrote(server, monkeypatch):
    """The engine held after the batch's second record while the batch is cancelled: the records that
    finish in that same token step are written (4 rows: at most 4 records in all), those still
    running are dropped at the next step."""
    import threading

    from flexh2o.server.batches import BatchRecord
    held, go, seen = threading.Event(), threading.Event(), []
    done = BatchRecord.done

    def holding(tag, request, tokens, reason):
        done(tag, request, tokens, reason)
        seen.append(reason)
        if len(seen) == 2:
            held.set()
            go.wait(60)
    monkeypatch.setattr(BatchRecord, "done", holding)
    client = server.client()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_lines(40, lambda k: 20))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert held.wait(60)
    with pytest.raises(openai.BadRequestError):
        client.files.delete(uploaded.id)  # the input of a batch still running
    assert client.batches.cancel(batch.id).status == "cancelling"
    go.set()
    ended = finished(client, batch.id)
    assert ended.status == "cancelled" and 2 <= ended.request_counts.completed <= 4
    assert len(outputs(client, ended.output_file_id)) == ended.request_counts.completed
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_batch_whose_output_cannot_be_written_fails_alone(server, monkeypatch):
    """A full disk under the batch's output: the batch fails, saying why; the server serves on."""
    import errno

    from flexh2o.jobs.files import WriteFailed
    from flexh2o.jobs.output import JobOutput

    def full(output, records):
        raise WriteFailed(output.path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    monkeypatch.setattr(JobOutput, "append", full)
    client = server.client()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_lines(12))), purpose="batch")
    done = finished(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
    assert done.status == "failed" and "No space left" in done.errors.data[0].message
    assert client.completions.create(model=server.service.state.ctx.model, prompt="hello", max_tokens=2).choices


def test_ids_never_become_paths_and_bad_uploads_are_refused(server):
    client = server.client()
    for name in ("../server.lock", "file-../../x", "file-" + "0" * 23 + "g", "batches"):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(name)
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve(name)
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("x.jsonl", io.BytesIO(b'{"custom_id": "a"}\nnot json\n')), purpose="batch")
    assert "line 2" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("x.jsonl", io.BytesIO(b'{"custom_id": ' + b"1" * 5000 + b"}\n")), purpose="batch")
    assert "line 1 of the file holds an integer of more than" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    good = client.files.create(file=("x.jsonl", io.BytesIO(batch_lines(1))), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="1h")
    wrong_url = client.files.create(file=("x.jsonl", io.BytesIO(batch_lines(2))), purpose="batch")
    done = finished(client, client.batches.create(input_file_id=wrong_url.id, endpoint="/v1/completions",
                                                  completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.failed == 2  # each record names the other endpoint


def start_process(word_llama, state_dir, offload_dir) -> tuple:
    process = subprocess.Popen([sys.executable, "-m", "flexh2o.serve", "--model", word_llama, "--gpu-batch-size", "4",
                                "--max-model-len", str(POSITIONS), "--dtype", "float32", "--port", "0", "--quiet",
                                "--state-dir", str(state_dir), "--offload-dir", str(offload_dir)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    assert " serving " in line, (line, process.stderr.read() if process.poll() is not None else "")
    url = line.split(" at ")[1].split()[0]
    return process, openai.OpenAI(base_url=url, api_key="none", max_retries=0)


RECORDS = 80


def stopped_mid_batch(process, client, lines: bytes, state_dir) -> str:
    """A batch of `lines`, and the server frozen (SIGSTOP) once some but not all of its records are
    written; where a try finds it finished already (a machine that ran it faster than this looked),
    another batch tries again."""
    for _ in range(5):
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        output = state_dir / "batches" / batch.id / "output.jsonl"
        wait_for(lambda: (output.exists() and output.stat().st_size) or not output.parent.exists() or
                 client.batches.retrieve(batch.id).status == "completed", "records written")
        process.send_signal(signal.SIGSTOP)
        if output.exists() and 0 < output.read_text().count("\n") < RECORDS:
            return batch.id
        process.send_signal(signal.SIGCONT)
        finished(client, batch.id)
    pytest.fail("every batch finished before the server could be stopped in its middle")


def test_a_batch_survives_a_killed_server(word_llama, tmp_path):
    """SIGKILL once some records are written; the same command finishes the batch: every custom_id
    once, each as an uninterrupted run of the same batch writes it."""
    lines = batch_lines(RECORDS, lambda k: 6 + k % 9)
    process, client = start_process(word_llama, tmp_path / "state", tmp_path / "offload")
    try:
        batch_id = stopped_mid_batch(process, client, lines, tmp_path / "state")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    process, client = start_process(word_llama, tmp_path / "state", tmp_path / "offload")
    try:
        done = finished(client, batch_id)
        records = outputs(client, done.output_file_id)
        listed = [json.loads(line)["custom_id"] for line in client.files.content(done.output_file_id).text.splitlines()]
        other = client.files.create(file=("in.jsonl", io.BytesIO(lines)), purpose="batch")
        want = outputs(client, finished(client, client.batches.create(
            input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h").id).output_file_id)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert done.status == "completed" and done.request_counts.completed == RECORDS
    assert sorted(listed) == sorted(f"req-{k}" for k in range(RECORDS))  # each once
    assert answers(records) == answers(want)


GOOD, BROKEN = "batch_" + "a" * 24, "batch_" + "b" * 24  # ids as the server makes them


def saved_batch(batch_id: str, **fields) -> dict:
    return {"id": batch_id, "object": "batch", "endpoint": "/v1/completions", "input_file_id": "file-1",
            "status": "completed", "created_at": 1, "request_counts": {"total": 1, "completed": 1, "failed": 0},
            "_output_file_id": "file-2", "_error_file_id": "file-3", **fields}


BROKEN_BATCHES = {
    "a-list": [],
    "null": None,
    "created-at-as-text": saved_batch(BROKEN, created_at="yesterday"),
    "unknown-status": saved_batch(BROKEN, status="done"),
    "unknown-endpoint": saved_batch(BROKEN, status="in_progress", endpoint="/v1/embeddings"),
    "input-file-id-a-number": saved_batch(BROKEN, status="in_progress", input_file_id=7),
    "counts-as-text": saved_batch(BROKEN, request_counts={"total": "1"}),
    "no-output-file-id": {k: v for k, v in saved_batch(BROKEN).items() if k != "_output_file_id"},
}


@pytest.mark.parametrize("case", BROKEN_BATCHES)
def test_a_saved_batch_of_another_shape_is_left_aside_in_one_warning(tmp_path, caplog, case):
    from flexh2o.server.batches import BatchStore
    (tmp_path / f"{GOOD}.json").write_text(json.dumps(saved_batch(GOOD)))
    (tmp_path / f"{BROKEN}.json").write_text(json.dumps(BROKEN_BATCHES[case]))
    store = BatchStore(str(tmp_path), None, None, (None, None), None, "m", {}, 64, 0)
    store.resume_all()  # a batch left aside starts no thread (none of this store's parts exist to run one)
    assert list(store.batches) == [GOOD] and store.threads == []
    assert [b.id for b in store.list()] == [GOOD]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"{tmp_path / (BROKEN + '.json')} is not a batch flexh2o wrote" in warned[0], warned
