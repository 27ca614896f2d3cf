"""The Files API's store in the state dir: files/<id>.jsonl holds a file's bytes, files/<id>.json
its OpenAI file object.

An id is `file-` and 24 hex digits, made here; any other id a client names is a 404, so an id
never becomes a path of its choosing. A file is written under a fresh temporary name (mkstemp:
created exclusively, no link followed) and renamed into place; its object is written after it,
atomically, and a file without one (a stop in between) is not listed. An upload for a batch is
checked as it is stored: UTF-8, each non-blank line a JSON object.
"""

import os
import re
import secrets
import tempfile
import time

from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.common.output_files import current_umask, write_json_atomic
from flexh2o.server.errors import ApiError, bad_request

ID = re.compile(r"file-[0-9a-f]{24}")
PURPOSES = ("batch",)
COPY_BYTES = 1 << 20


def not_found(file_id: str) -> ApiError:
    return ApiError(404, f"no file {file_id!r} on this server", "file_id", "file_not_found")


class FileStore:
    def __init__(self, directory: str):
        self.directory = directory

    def _path(self, file_id: str, suffix: str) -> str:
        return os.path.join(self.directory, file_id + suffix)

    def get(self, file_id: str) -> dict:
        if not isinstance(file_id, str) or not ID.fullmatch(file_id):
            raise not_found(str(file_id)[:100])
        try:
            with open(self._path(file_id, ".json"), "rb") as f:
                found = parse_json(f.read())
        except (OSError, BadJson):
            raise not_found(file_id) from None
        if not isinstance(found, dict) or found.get("id") != file_id:
            raise not_found(file_id)
        return found

    def content_path(self, file_id: str) -> str:
        self.get(file_id)
        return self._path(file_id, ".jsonl")

    def list(self, purpose: str | None = None) -> list[dict]:
        out = []
        for name in os.listdir(self.directory):
            if name.endswith(".json") and ID.fullmatch(name[:-5]):
                try:
                    found = self.get(name[:-5])
                except ApiError:
                    continue
                if purpose is None or found.get("purpose") == purpose:
                    out.append(found)
        return sorted(out, key=lambda f: (-f.get("created_at", 0), f["id"]))

    def create(self, source, filename: str, purpose: str, check_lines: bool = True) -> dict:
        """Stores the bytes of `source` (a binary file object) as a new file and returns its object."""
        if purpose not in PURPOSES:
            raise bad_request(f"purpose must be {' or '.join(PURPOSES)} (flexh2o keeps files for the Batch API), "
                              f"got {purpose!r}", "purpose")
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), 0o666 & ~current_umask())
                size = _copy_checked(source, out, check_lines)
                out.flush()
                os.fsync(out.fileno())
            return self._publish(tmp, size, filename, purpose)
        except BaseException:
            _remove(tmp)
            raise

    def _publish(self, path: str, size: int, filename: str, purpose: str, file_id: str | None = None) -> dict:
        file_id = file_id or "file-" + secrets.token_hex(12)
        os.replace(path, self._path(file_id, ".jsonl"))
        return self._describe(file_id, size, filename, purpose)

    def _describe(self, file_id: str, size: int, filename: str, purpose: str) -> dict:
        found = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                 "filename": filename, "purpose": purpose, "status": "processed", "status_details": None,
                 "expires_at": None}
        write_json_atomic(self._path(file_id, ".json"), found)
        return found

    def publish_as(self, path: str, file_id: str, filename: str, purpose: str) -> dict | None:
        """The file at `path` (in the state dir) made a stored file under an id chosen before (a
        batch's output), or None where there is no such file. Safe to repeat after a stop at any
        point: a file moved already keeps its place, and gets its object if it has none."""
        target = self._path(file_id, ".jsonl")
        if os.path.exists(path):
            os.replace(path, target)
        if not os.path.exists(target):
            return None
        try:
            return self.get(file_id)
        except ApiError:
            return self._describe(file_id, os.path.getsize(target), filename, purpose)

    def delete(self, file_id: str) -> dict:
        self.get(file_id)
        for suffix in (".json", ".jsonl"):
            _remove(self._path(file_id, suffix))
        return {"id": file_id, "object": "file", "deleted": True}


def _copy_checked(source, out, check_lines: bool) -> int:
    """Copies source to out; with check_lines, every non-blank line must be a JSON object (400 naming
    the first that is not)."""
    size, line, tail = 0, 0, b""
    while True:
        block = source.read(COPY_BYTES)
        if not block:
            break
        out.write(block)
        size += len(block)
        if check_lines:
            lines = (tail + block).split(b"\n")
            tail = lines.pop()
            for raw in lines:
                line += 1
                _check_line(raw, line)
    if check_lines:
        if tail:
            _check_line(tail, line + 1)
        if size == 0:
            raise bad_request("the file is empty: a batch's input holds one JSON request per line", "file")
    return size


def _check_line(raw: bytes, line: int):
    try:
        text = raw.decode("utf-8-sig" if line == 1 else "utf-8").strip()
    except UnicodeDecodeError as e:
        raise bad_request(f"line {line} of the file is not UTF-8 text (byte {e.start}): a batch's input holds one "
                          "JSON request per line", "file") from None
    try:
        if text and not isinstance(parse_json(text), dict):
            raise BadJson("is not a JSON object")
    except BadJson as e:
        raise bad_request(f"line {line} of the file {e}: a batch's input holds one JSON request per line",
                          "file") from None


def _remove(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
