"""The harness's requests as the engine runs them, checked before any weight loads.

A Scored item prefills `prompt`, then feeds `fed` one token at a time (teacher forcing: the cache
keeps, evicts and compresses exactly as when generating) and sums the log-probabilities of its
last `scored` fed tokens; the prompt step's logits score the first fed token, and the last fed
token is scored but never fed. A loglikelihood request is its context prefilled and its
continuation fed (with model_args streamed=N, the context's last N tokens are fed too, unscored,
so that the continuation is read from a cache that evicted while the context was read).

Positions: an item of prompt + fed tokens computes len(prompt) + len(fed) - 1 positions, and the
engine takes prompt_len + gen_len up to the model's positions, so the longest request lm-eval
forms, max_length + 1 tokens, fits with max_length = positions - 1 (the default here; lm-eval's
hf model uses every position, so pass max_length to both when comparing long windows).
"""

from dataclasses import dataclass

from flexh2o.common.errors import UsageError
from flexh2o.kv import check_budget


@dataclass(frozen=True)
class Scored:
    prompt: tuple
    fed: tuple
    scored: int
    task: str | None = None  # the lm-eval task it came from, for errors


@dataclass(frozen=True)
class Context:
    """A generate_until request: its context prefilled, up to max_tokens generated."""
    tokens: tuple
    max_tokens: int
    task: str | None = None


def too_long(task, what: str, limit_flag: str) -> UsageError:
    return UsageError("--tasks", f"task {task or '?'}: {what}; the model runs at most {limit_flag}. Give "
                      f"model_args truncate=true to cut contexts from the left, as lm-eval's hf model does, or "
                      f"a task with shorter requests")


def loglikelihood_item(context: list, continuation: list, max_length: int, truncate: bool, streamed: int,
                       task=None) -> Scored:
    if not continuation:
        raise UsageError("--tasks", f"task {task or '?'}: a loglikelihood request with an empty continuation")
    if len(continuation) > max_length:
        raise too_long(task, f"a continuation of {len(continuation)} tokens", f"max_length {max_length}")
    if len(context) + len(continuation) > max_length + 1:
        if not truncate:
            raise too_long(task, f"a request of {len(context)} context + {len(continuation)} continuation tokens "
                           f"exceeds max_length {max_length} + 1", f"max_length {max_length} + 1 tokens")
        context = context[len(context) + len(continuation) - max_length - 1:]
    kept = max(1, len(context) - streamed)
    return Scored(tuple(context[:kept]), tuple(context[kept:]) + tuple(continuation), len(continuation), task)


def context_item(tokens: list, max_tokens: int, positions: int, truncate: bool, task=None) -> Context:
    if max_tokens >= positions:
        raise UsageError("--gen_kwargs", f"task {task or '?'}: max_gen_toks {max_tokens} leaves no room for a "
                         f"context in the model's {positions} positions")
    if len(tokens) + max_tokens > positions:
        if not truncate:
            raise too_long(task, f"a context of {len(tokens)} tokens + max_gen_toks {max_tokens}",
                           f"{positions} positions")
        tokens = tokens[len(tokens) + max_tokens - positions:]
    return Context(tuple(tokens), max_tokens, task)


def check_budgets(policy, prompts: list) -> None:
    """Refuses a KV policy whose budget rounds to zero slots for the shortest prefilled prompt."""
    if policy.kv_policy == "full" or not prompts:
        return
    shortest, task = min(((len(tokens), task) for tokens, task in prompts), key=lambda pair: pair[0])
    try:
        check_budget(policy, shortest)
    except UsageError as e:
        where = (f"task {task or '?'}'s shortest prefilled context" if shortest > 1 else
                 f"task {task or '?'}: loglikelihood_rolling's first window prefills one token, so perplexity tasks "
                 f"need kv_policy=full")
        raise UsageError(f"model_args {e.flag.lstrip('-').replace('-', '_')}",
                         f"{e.message.replace('prompt_len', 'a prefilled prompt of')} ({where})") from None
