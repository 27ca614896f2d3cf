"""A dataset job's input: records read from a file, checked, and indexed without holding their tokens.

Three formats, told apart by the file's first non-blank line:

- plain text: one prompt per non-blank line, its id the line number;
- JSONL: `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [{"role", "content"}, ...]}`
  (the chat template applied), each optionally with max_tokens, temperature, top_p, top_k, stop
  (a string or a list of them) and seed;
- the OpenAI Batch format: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
  "/v1/completions", "body": {...}}`, the same fields inside the body (max_completion_tokens too).

`index_records` reads the file once, line by line: every record is checked and tokenized then,
before any weight loads, and only its id, where it lies in the file and its length are kept, so
memory stays flat however many records there are. A block's prompts are read again when it runs
(`JobInput.request`), and each line read again must hash to what it did the first time: the file's
size and modified time say nothing (a file rewritten with its old time put back, /proc's files of
size 0). The reading also takes the file's fingerprint (its size and a SHA-256 of its bytes), which
a resumed job must match.
"""

import hashlib
import math
from dataclasses import dataclass

from flexh2o.common.arguments import shown
from flexh2o.checkpoints.chat_template import ChatTemplateError, render_chat
from flexh2o.common.errors import UsageError, check_regular_file
from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.runs.prompts import template_source
from flexh2o.engine.sampling import MAX_SEED

FORMATS = ("text", "jsonl", "openai")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_STOPS = 4
MAX_LINE = 16 << 20  # bytes in one record: far beyond any model's context, short of exhausting memory
MAX_ID = 1 << 63     # integer ids within a signed 64-bit integer


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a record's tokens are chosen; records of a block share it (the seed is per record)."""
    temperature: float  # 0: greedy
    top_p: float
    top_k: int


@dataclass(frozen=True, slots=True)
class Entry:
    """What the index keeps of a record: no text, no tokens."""
    number: int          # 0-based, in file order
    id: str
    line: int            # 1-based line of the file
    offset: int          # byte offset of that line
    prompt_tokens: int
    max_tokens: int
    sampling: Sampling
    seed: int | None
    error: str | None = None  # a bad record kept by --skip-bad: what is wrong with it
    given_id: int | None = None  # an integer id as the record gave it (`id` is its text), written back as is
    digest: int | None = None  # of the line's bytes as first read (line_digest): read again, it must match


@dataclass
class Request:
    """A record as parsed: its prompt (text or chat messages) and its settings."""
    id: str
    prompt: str | None
    messages: list | None
    max_tokens: int
    sampling: Sampling
    stop: tuple
    seed: int | None
    given_id: int | None = None  # an integer id as given


class BadRecord(ValueError):
    """What is wrong with a record; param: the field it is about, where one is (an OpenAI error's)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def sampling(temperature: float, top_p: float, top_k: int) -> Sampling:
    """Greedy whatever top-p and top-k say: records that differ only there share blocks."""
    return Sampling(0.0, 1.0, 0) if temperature == 0 else Sampling(temperature, top_p, top_k)


def detect_format(path: str) -> str:
    """"text" where the first non-blank line does not start a JSON object; otherwise the first line
    that parses as an object decides ("openai" where it has a custom_id), so that a broken first
    record, an error record under --skip-bad, does not decide how the others are read."""
    check_regular_file(path, "--input")
    for n, (_, _, text, _) in enumerate(lines_of(path)):
        if n == 0 and not text.startswith("{"):
            return "text"
        try:
            record = parse_json(text)
        except BadJson:
            continue
        if isinstance(record, dict):
            return "openai" if "custom_id" in record else "jsonl"
    return "jsonl"


def number_field(record: dict, key: str, kind, default, low, high, low_open=False):
    """record[key] (default where absent or null): a number of `kind` (int: no fraction) within
    [low, high] ((low, high] where low_open)."""
    value = record.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRecord(f"{key} must be {'an integer' if kind is int else 'a number'}, got {shown(value)}", key)
    if isinstance(value, int) and not -high <= value <= high:  # (beyond a float's range, math.isfinite raises)
        raise BadRecord(f"{key} must be within [{low}, {high}], got {shown(value)}", key)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise BadRecord(f"{key} must be within {'(' if low_open else '['}{low}, {high}], got {value!r}", key)
    return kind(value)


def check_text(name: str, text: str, param: str | None = None):
    """Refuses a string that no UTF-8 file can hold (a lone UTF-16 surrogate, from a \\ud800 escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord(f"{name} holds a lone UTF-16 surrogate ({text[e.start]!a} at character {e.start}), "
                        "not text", param) from None


def stop_strings(value) -> tuple:
    """A record's stop: none, a non-empty string, or a list of at most MAX_STOPS of them."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRecord(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them, "
                        f"got {shown(value)}", "stop")
    for s in stops:
        check_text("stop", s, "stop")
    return tuple(stops)


def chat_messages(value) -> list:
    """A record's messages: a non-empty list of {"role", "content"} objects with string values."""
    if not isinstance(value, list) or not value:
        raise BadRecord("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRecord("each message needs a string role and a string content", "messages")
        check_text("a message's role", m["role"], "messages")
        check_text("a message's content", m["content"], "messages")
    return value


def parse_record(text: str, fmt: str, line: int, defaults: dict, urls: tuple = OPENAI_URLS) -> Request:
    """One line of the file as a Request (BadRecord saying what is wrong otherwise). defaults:
    max_tokens (None: what the model's positions leave after the prompt), temperature, top_p,
    top_k, seed of the command line. urls: the endpoints an OpenAI Batch record may name."""
    if fmt == "text":
        return Request(str(line), text, None, defaults["max_tokens"],
                       sampling(defaults["temperature"], defaults["top_p"], defaults["top_k"]), (), defaults["seed"])
    try:
        record = parse_json(text)
    except BadJson as e:
        raise BadRecord(f"the line {e}") from None
    if not isinstance(record, dict):
        raise BadRecord("a record must be a JSON object")
    if fmt == "openai":
        rid, body = record.get("custom_id"), record.get("body")
        if record.get("method", "POST") != "POST" or record.get("url") not in urls:
            raise BadRecord(f"url must be {' or '.join(urls)} with method POST", "url")
        if not isinstance(body, dict):
            raise BadRecord("body must be a JSON object")
        chat = record["url"] == OPENAI_URLS[0]
        record = dict(body, id=rid)
        if "max_completion_tokens" in body and "max_tokens" not in body:
            record["max_tokens"] = body["max_completion_tokens"]
        prompt = None if chat else record.get("prompt")
        messages = chat_messages(record.get("messages")) if chat else None
    else:
        rid = record.get("id", line)
        prompt, messages = record.get("prompt"), record.get("messages")
        if (prompt is None) == (messages is None):
            raise BadRecord("give exactly one of prompt and messages")
        if messages is not None:
            messages = chat_messages(messages)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or (isinstance(rid, str) and not rid) or \
            (isinstance(rid, int) and not -MAX_ID <= rid < MAX_ID):
        raise BadRecord(f"id must be a non-empty string or an integer within a signed 64-bit integer, got {shown(rid)}")
    if isinstance(rid, str):
        check_text("id", rid, "custom_id" if fmt == "openai" else "id")
    if messages is None and (not isinstance(prompt, str) or not prompt):
        raise BadRecord("prompt must be a non-empty string")
    if messages is None:
        check_text("prompt", prompt, "prompt")
    max_tokens = number_field(record, "max_tokens", int, defaults["max_tokens"], 1, 1 << 20)
    chosen = sampling(number_field(record, "temperature", float, defaults["temperature"], 0.0, 100.0),
                      number_field(record, "top_p", float, defaults["top_p"], 0.0, 1.0, low_open=True),
                      number_field(record, "top_k", int, defaults["top_k"], 0, 1 << 31))
    seed = number_field(record, "seed", int, defaults["seed"], 0, MAX_SEED)
    return Request(str(rid), prompt, messages, max_tokens, chosen, stop_strings(record.get("stop")), seed,
                   rid if isinstance(rid, int) else None)


def prompt_ids(tokenizer, request: Request, chat: bool) -> list[int]:
    """The prompt's token ids: chat messages (or a plain prompt under --chat) through the chat template."""
    if request.messages is not None or chat:
        messages = request.messages or [{"role": "user", "content": request.prompt}]
        if not getattr(tokenizer, "chat_template", None):
            raise BadRecord("chat messages need a tokenizer with a chat template; this model's has none")
        try:
            text = render_chat(tokenizer, messages, template_source(tokenizer))
        except ChatTemplateError as e:
            raise BadRecord(str(e)) from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(request.prompt)["input_ids"]


def prompt_length(tokenizer, request: Request, chat: bool) -> int:
    """The prompt's token count; BadRecord where the tokenizer makes no token of it (whitespace alone,
    with many tokenizers): the engine needs one to predict from."""
    n = len(prompt_ids(tokenizer, request, chat))
    if n == 0:
        raise BadRecord("the prompt has no tokens with this model's tokenizer (is it only whitespace?)")
    return n


class Fingerprint:
    """The input as read: its size and a hash of its bytes."""

    def __init__(self):
        self.size, self.hash = 0, hashlib.sha256()

    def add(self, raw: bytes):
        self.size += len(raw)
        self.hash.update(raw)

    def to_dict(self) -> dict:
        return {"size": self.size, "sha256": self.hash.hexdigest()}


def line_digest(raw: bytes) -> int:
    """64 bits of a line's hash: what an index entry keeps to know its line when it is read again."""
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def lines_of(path: str, fingerprint: list | None = None):
    """(line number, byte offset, text, line_digest of its bytes) of every non-blank line, read one
    at a time; the file's Fingerprint is appended to `fingerprint`."""
    offset = 0
    with open(path, "rb") as f:
        seen = Fingerprint()
        if fingerprint is not None:
            fingerprint.append(seen)
        for number in range(1, 1 << 62):
            raw = f.readline(MAX_LINE + 1)
            if not raw:
                break
            if len(raw) > MAX_LINE:
                raise UsageError("--input", f"{path}:{number}: a line longer than {MAX_LINE >> 20} MB: not a "
                                 "record (one prompt per line)")
            seen.add(raw)
            start, offset = offset, offset + len(raw)
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            except UnicodeDecodeError as e:
                raise UsageError("--input", f"{path}:{number}: not UTF-8 text (byte {e.start})") from None
            if "\0" in text:
                raise UsageError("--input", f"{path}:{number}: not text (a NUL byte at character "
                                 f"{text.index(chr(0))})")
            if text:
                yield number, start, text, line_digest(raw)


def read_line(path: str, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.readline(MAX_LINE + 1)


class JobInput:
    """The records of an input file: format, and one Entry per record, in file order."""

    def __init__(self, path: str, tokenizer, defaults: dict, max_positions: int, chat: bool = False,
                 skip_bad: bool = False, urls: tuple = OPENAI_URLS):
        self.path, self.tokenizer, self.defaults, self.chat, self.urls = path, tokenizer, defaults, chat, urls
        try:
            self.format = detect_format(path)
        except OSError as e:
            raise UsageError("--input", f"cannot read {path}: {e.strerror}") from None
        self.entries, self.bad, seen, read = [], 0, set(), []
        for line, offset, text, digest in lines_of(path, read):
            try:
                request = parse_record(text, self.format, line, defaults, urls)
                if request.id in seen:
                    raise BadRecord(f"id {request.id!r} appears twice")
                n = prompt_length(tokenizer, request, chat)
                if request.max_tokens is None:
                    request.max_tokens = max_positions - n
                if request.max_tokens < 1 or n + request.max_tokens > max_positions:
                    raise BadRecord(f"{n} prompt tokens + max_tokens {request.max_tokens} exceed the model's "
                                    f"{max_positions} positions")
            except BadRecord as e:
                if not skip_bad:
                    raise UsageError("--input", f"{path}:{line}: {e} (--skip-bad writes such records to the "
                                     "output as errors and goes on)") from None
                self.bad += 1
                rid = f"line-{line}"
                self.entries.append(Entry(len(self.entries), rid, line, offset, 0, 0, sampling(0, 1, 0), None,
                                          str(e)))
                continue
            seen.add(request.id)
            self.entries.append(Entry(len(self.entries), request.id, line, offset, n, request.max_tokens,
                                      request.sampling, request.seed, given_id=request.given_id, digest=digest))
        if not self.entries:
            raise UsageError("--input", f"{path} holds no records")
        self.fingerprint = read[0].to_dict()
        taken = next((e for e in self.entries if e.error is not None and e.id in seen), None)
        if taken is not None:
            raise UsageError("--input", f"{path}:{taken.line}: a bad record, whose error record takes the id "
                             f"{taken.id!r}, and another record has that id: give that record another id")

    def read_again(self, entry: Entry) -> str:
        """The entry's line, refused where its bytes are not those indexed (the file changed since)."""
        try:
            raw = read_line(self.path, entry.offset)
        except OSError as e:
            raise UsageError("--input", f"cannot read {self.path} again: {e.strerror}") from None
        if line_digest(raw) != entry.digest:
            raise UsageError("--input", f"{self.path} changed while the job ran (line {entry.line} is not what it "
                             "was when the job began): the records written so far are kept; put the input back as "
                             "it was and run the same command to finish, or give a new input another --output")
        return raw.decode("utf-8-sig" if entry.offset == 0 else "utf-8").strip()

    def request(self, entry: Entry) -> Request:
        request = parse_record(self.read_again(entry), self.format, entry.line, self.defaults, self.urls)
        request.max_tokens = entry.max_tokens  # (the default, where it depends on the prompt's length)
        return request

    def tokens(self, entry: Entry) -> tuple[Request, list[int]]:
        request = self.request(entry)
        return request, prompt_ids(self.tokenizer, request, self.chat)
