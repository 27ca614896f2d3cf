"""generate_until requests run as a dataset job (jobs/job.py) over already tokenized contexts:
length-sorted blocks, stop strings and EOS, each block at its plan."""

from flexh2o.jobs.input import Entry, Request
from flexh2o.jobs.job import Job
from flexh2o.jobs.llm import Collected, CompletionFormat


class TokenContexts:
    """Contexts (requests.Context) with their settings, as a job's input (jobs/input.py's interface)."""

    def __init__(self, contexts: list, stops: list, sampling, seed: int | None):
        self.contexts = contexts
        self.requests = [Request(str(n), None, None, c.max_tokens, sampling, tuple(stop), seed)
                         for n, (c, stop) in enumerate(zip(contexts, stops))]
        self.entries = [Entry(n, str(n), 0, 0, len(c.tokens), c.max_tokens, sampling, seed)
                        for n, c in enumerate(contexts)]

    def tokens(self, entry: Entry):
        return self.requests[entry.number], list(self.contexts[entry.number].tokens)


def generate(engine, contexts: list, stops: list, sampling, seed, tokenizer, eos_ids, plans,
             advance=lambda done: None) -> list[str]:
    """One text per context, in order: generated until EOS, max_tokens or a stop string (cut before it)."""
    collected = Collected()
    job = Job(engine, TokenContexts(contexts, stops, sampling, seed), collected, tokenizer, CompletionFormat(),
              eos_ids, plans=plans)
    for completions in job.run():
        advance(len(completions))
    return [c.text for c in sorted(collected.completions, key=lambda c: c.index)]
