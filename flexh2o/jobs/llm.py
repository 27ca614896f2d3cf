"""The Python API of dataset jobs: LLM(model, ...).generate(prompts) for a list of any size.

    from flexh2o import LLM
    llm = LLM("path/to/model", kv_policy="h2o", hh_ratio=0.2, gpu_batch_size=16)
    for c in llm.generate(["Summarize: ...", "Translate: ..."], max_tokens=64):
        print(c.text)

The weights load once, in the constructor; generate() runs the same scheduler as the command
line's --input (jobs/job.py: the batch's slots, each taking the next prompt when its sequence stops)
and returns one Completion per prompt in input order, with a progress bar (progress=False: none).
stream() takes any iterable and yields Completions chunk by chunk, reading CHUNK prompts ahead at a
time, for jobs that do not fit in memory. Every argument is checked (common/arguments.py) when the call is made.
"""

import itertools
import threading
from dataclasses import dataclass

import torch

from flexh2o.common.arguments import number, placement, stops, switch, text, whole
from flexh2o.engine.engine import Engine
from flexh2o.common.messages import progress_bar
from flexh2o.common.errors import UsageError
from flexh2o.jobs.job import Job
from flexh2o.jobs.plans import FixedPlan
from flexh2o.jobs.input import (BadRecord, Entry, Request, chat_messages, check_text, prompt_ids, prompt_length,
                                sampling)
from flexh2o.models import eos_ids, resolve_model
from flexh2o.engine.policy import Policy
from flexh2o.runs.prompts import load_tokenizer
from flexh2o.engine.sampling import MAX_SEED

CHUNK_BATCHES = 16  # stream(): prompts read ahead, in batches of the engine


@dataclass(frozen=True)
class Completion:
    index: int            # the prompt's place in the input
    text: str
    finish_reason: str    # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


class _Prompts:
    """A chunk of prompts as a job's input (jobs/input.py: JobInput's interface, from memory)."""

    def __init__(self, llm, prompts: list, first: int, settings: dict):
        self.llm, self.first, self.requests, self.entries = llm, first, [], []
        for n, p in enumerate(prompts):
            messages = p if isinstance(p, list) else None
            if messages is None and (not isinstance(p, str) or not p):
                raise UsageError("prompts", f"prompt {first + n} must be a non-empty string or a list of chat "
                                 f"messages, got {str(p)[:80]!r}")
            request = Request(str(first + n), None if messages else p, messages, settings["max_tokens"],
                              settings["sampling"], settings["stop"], settings["seed"])
            try:
                if messages is not None:
                    chat_messages(messages)
                else:
                    check_text("the prompt", p)
                tokens = prompt_length(llm.tokenizer, request, llm.chat)
            except BadRecord as e:
                raise UsageError("prompts", f"prompt {first + n}: {e}") from None
            if tokens + request.max_tokens > llm.spec.max_positions:
                raise UsageError("prompts", f"prompt {first + n}: {tokens} tokens + max_tokens "
                                 f"{request.max_tokens} exceed the model's {llm.spec.max_positions} positions")
            self.requests.append(request)
            self.entries.append(Entry(first + n, request.id, first + n, 0, tokens, request.max_tokens,
                                      request.sampling, request.seed))

    def tokens(self, entry: Entry):
        request = self.requests[entry.number - self.first]
        return request, prompt_ids(self.llm.tokenizer, request, self.llm.chat)


class Collected:
    """A job's output kept in memory."""

    def __init__(self):
        self.done, self.completions = set(), []

    def append(self, completions: list):
        self.completions += completions
        self.done.update(str(c.index) for c in completions)


class CompletionFormat:
    def result(self, entry, request, text, finish_reason, prompt_tokens, completion_tokens) -> Completion:
        return Completion(entry.number, text, finish_reason, prompt_tokens, completion_tokens)


def prompt_source(prompts):
    """The prompts as given: any iterable of them, but not one prompt alone (a string is an iterable
    of characters, and a list of message dicts would be taken as as many prompts)."""
    if isinstance(prompts, (str, bytes)):
        raise UsageError("prompts", "must be a list (or any iterable) of prompts, got one string: give [prompt]")
    if isinstance(prompts, list) and prompts and all(isinstance(p, dict) for p in prompts):
        raise UsageError("prompts", "must be a list of prompts, got one chat (a list of messages): give [messages]")
    try:
        iter(prompts)
    except TypeError:
        raise UsageError("prompts", f"must be a list (or any iterable) of prompts, got {type(prompts).__name__}") \
            from None
    return prompts


class LLM:
    """A loaded model for lists of prompts of any size: generate() returns a Completion per prompt."""

    def __init__(self, model: str, path: str | None = None, *, gpu_batch_size: int = 8, num_gpu_batches: int = 1,
                 weights: tuple = (100, 0), cache: tuple = (100, 0), kv_policy: str | None = None,
                 hh_ratio: float | None = None, recent_ratio: float | None = None, compress_weight: bool = False,
                 compress_cache: bool = False, device=None, dtype=None, offload_dir: str | None = None,
                 chat: bool = False, seed: int = 0):
        """Loads a model with its tokenizer.

        model, path: as flexh2o.run's --model and --path: a Hugging Face directory or a .gguf file
            with a tokenizer, or a preset name with path its weights directory.
        gpu_batch_size, num_gpu_batches: prompts a layer call computes at once, and such groups in
            a block.
        weights, cache: (percent on the compute device, percent in CPU memory), the rest on disk
            in offload_dir.
        kv_policy, hh_ratio, recent_ratio, compress_weight, compress_cache: as Policy's fields.
        device, dtype: as Engine.from_pretrained's.
        chat: a plain-string prompt goes through the model's chat template as a user turn (a list
            of chat messages always does).
        seed: the seed every prompt's sampling seed comes from (with its index)."""
        model, path = text("model", model), text("path", path, none=True)
        for name, value in (("gpu_batch_size", gpu_batch_size), ("num_gpu_batches", num_gpu_batches)):
            whole(name, value, 1)
        weights, cache = placement("weights", weights), placement("cache", cache)
        for name, value in (("compress_weight", compress_weight), ("compress_cache", compress_cache), ("chat", chat)):
            switch(name, value)
        offload_dir, seed = text("offload_dir", offload_dir, none=True), whole("seed", seed, 0, MAX_SEED)
        self.spec, weights_dir = resolve_model(model, path)
        self.tokenizer = load_tokenizer(weights_dir)
        if self.tokenizer is None:
            raise UsageError("model", "needs a tokenizer next to the weights (a directory with tokenizer files or a "
                             "GGUF file)")
        self.chat, self.seed = chat, seed
        self._reporting = threading.local()  # .inside: this thread runs a progress callback of this LLM's
        try:
            policy = Policy(gpu_batch_size, num_gpu_batches, weights[0], weights[1], cache[0], cache[1],
                            kv_policy=kv_policy, hh_ratio=hh_ratio, recent_ratio=recent_ratio,
                            compress_weight=compress_weight, compress_cache=compress_cache)
        except UsageError as e:  # named as the command line's flags: said as this API's arguments
            raise UsageError("weights/cache" if e.flag == "--percent" else e.flag.lstrip("-").replace("-", "_"),
                             e.message) from None
        self.policy = policy  # every call's blocks at this batch (a short block sets the engine's own for itself)
        self.engine = Engine.from_pretrained(model, policy=policy, device=device, dtype=dtype, path=path,
                                             offload_dir=offload_dir, seed=seed)

    def generate(self, prompts, max_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 stop=None, seed: int | None = None, progress: bool = True) -> list[Completion]:
        """One Completion per prompt (a string, or a list of chat messages), in input order.

        max_tokens: tokens to generate per prompt at most.
        temperature, top_p, top_k: sampling; temperature 0 is greedy.
        stop: a string or list of strings that end a completion (not included in its text).
        seed: every prompt's sampling seed (default: from the LLM's seed and the prompt's index,
            so a prompt's tokens do not depend on the prompts beside it).
        progress: a progress bar on stderr, moving as prompts finish."""
        self._check_not_inside("generate")
        switch("progress", progress)
        prompts = prompt_source(prompts)
        total = len(prompts) if hasattr(prompts, "__len__") else None
        with progress_bar(total=total, unit="prompt", desc="generate", disable=not progress, dynamic_ncols=True) as bar:
            out = list(self.stream(prompts, max_tokens, temperature, top_p, top_k, stop, seed,
                                   progress=lambda records, tokens: bar.update(records)))
        out.sort(key=lambda c: c.index)
        return out

    def stream(self, prompts, max_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               stop=None, seed: int | None = None, progress=None):
        """Completions as each chunk of prompts finishes, for any number of prompts from any iterable
        (not in input order: each Completion has its index). The arguments are generate()'s;
        progress(records, tokens), if given, is called as records finish (generate, stream or close
        called from inside it is refused: the engine runs one call at a time)."""
        self._check_not_inside("stream")
        settings = {"max_tokens": whole("max_tokens", max_tokens, 1, 1 << 20),
                    "sampling": sampling(number("temperature", temperature, 0, 100),
                                         number("top_p", top_p, 0, 1, low_open=True), whole("top_k", top_k, 0)),
                    "stop": stops("stop", stop), "seed": whole("seed", seed, 0, MAX_SEED, none=True)}
        if progress is not None and not callable(progress):
            raise UsageError("progress", f"must be a function (records, tokens), or None, got {progress!r}")
        return self._stream(prompt_source(prompts), settings, None if progress is None else self._reported(progress))

    def _reported(self, progress):
        """progress, noting the thread that runs it: a generate, stream or close from inside it is
        refused whether or not the engine's call is still running at that moment (it has ended when
        the last records are reported), so that such a call fails the same way every time."""
        def report(records: int, tokens: int):
            self._reporting.inside = True
            try:
                progress(records, tokens)
            finally:
                self._reporting.inside = False
        return report

    def _check_not_inside(self, name: str):
        if getattr(self._reporting, "inside", False):
            raise UsageError(name, "called from inside the progress callback of this LLM's running generate or "
                             "stream, where it would wait for the engine that call holds: call it once that call "
                             "has returned")
        self.engine.calls.check_not_inside(name)

    def _stream(self, prompts, settings: dict, progress):
        chunk = CHUNK_BATCHES * self.policy.batch_size
        source, first = iter(prompts), 0
        while True:
            part = list(itertools.islice(source, chunk))
            if not part:
                return
            collected = Collected()
            job = Job(self.engine, _Prompts(self, part, first, settings), collected, self.tokenizer,
                      CompletionFormat(), eos_ids(self.spec), self.seed, progress, FixedPlan(self.policy))
            with torch.no_grad():
                for completions in job.run():
                    yield from completions
            first += len(part)

    def close(self):
        """Removes the engine's offload files and stops its I/O threads (or use a with-block)."""
        self._check_not_inside("close")
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
