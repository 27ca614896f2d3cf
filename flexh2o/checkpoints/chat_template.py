"""A model's chat template is data from its file: rendered in a sandbox, with a time and a size limit.

transformers already renders templates in jinja2's immutable sandbox; here every way a template can
fail (a syntax error, raise_exception, an include, an attribute the sandbox forbids, a recursion)
becomes one ChatTemplateError naming the file, and two limits are added: MAX_SECONDS per render (a
template that loops forever is stopped by an alarm; off the main thread, by a trace function) and
MAX_CHARS of text, also inside the template (`'x' * 10**9` and `10 ** 10 ** 9` are refused as they
are computed, not after).
"""

import functools
import signal
import sys
import threading
import time
from contextlib import contextmanager

MAX_SECONDS = 10.0
MAX_CHARS = 1 << 22  # 4 M characters: far beyond any context window


class ChatTemplateError(ValueError):
    """The template failed to render; the message says how."""


class TemplateTimeout(Exception):
    pass


def render_chat(tokenizer, messages: list, source: str) -> str:
    """The messages through the tokenizer's chat template, ready for the assistant's reply.
    source: the model file or directory the template came from (named in errors)."""
    try:
        with limited_time(MAX_SECONDS), limited_operations():
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except ChatTemplateError as e:  # a limit checked_binop enforces
        raise ChatTemplateError(f"the chat template of {source}: {e}") from None
    except TemplateTimeout:
        raise ChatTemplateError(f"the chat template of {source} ran for over {MAX_SECONDS:g} s (a loop?) "
                                "and was stopped") from None
    except RecursionError:
        raise ChatTemplateError(f"the chat template of {source} recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError(f"the chat template of {source} ran out of memory") from None
    except Exception as e:  # a template is code from the model file: whatever it raises is its own failure
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise ChatTemplateError(f"the chat template of {source} failed: {type(e).__name__}: {reason}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template of {source} gave {type(text).__name__}, not text")
    if len(text) > MAX_CHARS:
        raise ChatTemplateError(f"the chat template of {source} made {len(text)} characters, over {MAX_CHARS}")
    return text


@contextmanager
def limited_time(seconds: float):
    """TemplateTimeout raised into the code inside once `seconds` pass."""
    if threading.current_thread() is not threading.main_thread():
        with traced_deadline(time.monotonic() + seconds):
            yield
        return
    running = [True]

    def alarm(signum, frame):
        if running[0]:  # (an alarm that lands just after the render is dropped)
            running[0] = False
            raise TemplateTimeout()
    previous = signal.signal(signal.SIGALRM, alarm)
    began = time.monotonic()
    theirs, _ = signal.setitimer(signal.ITIMER_REAL, seconds)  # a timer the caller had set: put back after
    try:
        yield
    finally:
        running[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if theirs > 0:
            signal.setitimer(signal.ITIMER_REAL, max(theirs - (time.monotonic() - began), 1e-3))


@contextmanager
def traced_deadline(deadline: float):
    """Off the main thread (no signal reaches it): a trace function checks the time at each line."""
    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout()
        return check
    before = sys.gettrace()
    sys.settrace(check)
    try:
        yield
    finally:
        sys.settrace(before)


def checked_binop(operator, left, right):
    """`*` and `**` in a template, refused where the result would exceed MAX_CHARS (as text or digits)."""
    if operator == "*" and isinstance(right, (str, list, tuple)):
        left, right = right, left
    if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
        if len(left) * right > MAX_CHARS:
            raise ChatTemplateError(f"the template repeats {len(left)} items {right} times, over {MAX_CHARS}")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right * abs(left).bit_length() > MAX_CHARS * 4:
            raise ChatTemplateError(f"the template raises {left} to the power {right}: too large a number")
    return None


@contextmanager
def limited_operations():
    """While inside, templates that transformers compiles intercept `*` and `**` (checked_binop).
    Where transformers' internals differ from what is expected, templates render as it makes them."""
    try:
        from transformers.utils import chat_template_utils as utils
        original = utils._compile_jinja_template
        original.__wrapped__
    except (ImportError, AttributeError):
        yield
        return
    utils._compile_jinja_template = functools.partial(_compile_limited, original)
    try:
        yield
    finally:
        utils._compile_jinja_template = original


def _compile_limited(original, template: str):
    return _limited_template(original, template)


@functools.lru_cache(maxsize=16)
def _limited_template(original, template: str):
    """The template compiled by transformers' own environment (its filters, globals and extensions,
    taken from an empty template's: compiling the model's own would already fold its constants, such
    as `[1] * 10**9`), made a LimitedSandbox."""
    environment = original("").environment.overlay()
    environment.__class__ = _limited_class(type(environment))
    return environment.from_string(template)


@functools.lru_cache(maxsize=None)
def _limited_class(base):
    class LimitedSandbox(base):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            checked_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)
    return LimitedSandbox
