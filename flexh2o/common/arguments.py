"""The Python API's arguments checked by type and range: a UsageError naming the argument and what is
accepted, not a TypeError from deep inside, and nothing of the wrong type taken silently."""

import math
import os

from flexh2o.common.errors import UsageError

MAX_STOPS = 4


def whole(name: str, value, low: int, high: int | None = None, none: bool = False):
    """An integer (not a bool) within [low, high]; None where `none`."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(name, f"must be an integer{' or None' if none else ''}, got {shown(value)}")
    if value < low or (high is not None and value > high):
        raise UsageError(name, f"must be within {low}..{'' if high is None else high}, got {shown(value)}")
    return value


def number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """A finite real number (not a bool) within [low, high] ((low, high] where low_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(name, f"must be a number, got {shown(value)}")
    if isinstance(value, int) and abs(value) > 1 << 60:
        value = math.copysign(math.inf, value)  # (beyond a float's range, float() raises)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        raise UsageError(name, f"must be within {'(' if low_open else '['}{low}, {high}], got {shown(value)}")
    return float(value)


def switch(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise UsageError(name, f"must be True or False, got {shown(value)}")
    return value


def text(name: str, value, none: bool = False) -> str | None:
    """A non-empty string or path (os.PathLike), as a string; None where `none`."""
    if value is None and none:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise UsageError(name, f"must be a non-empty string{' or None' if none else ''}, got {shown(value)}")
    return value


def placement(name: str, value) -> tuple:
    """(percent on the compute device, percent in CPU memory), each within 0..100."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise UsageError(name, f"must be a pair (percent on the compute device, percent in CPU memory), "
                         f"got {shown(value)}")
    return tuple(number(name, v, 0, 100) for v in value)


def stops(name: str, value) -> tuple:
    """None, a non-empty string, or a list or tuple of at most MAX_STOPS of them."""
    if value is None:
        return ()
    many = [value] if isinstance(value, str) else value
    if not isinstance(many, (list, tuple)) or not 0 < len(many) <= MAX_STOPS or \
            not all(isinstance(s, str) and s for s in many):
        raise UsageError(name, f"must be a non-empty string or a list of 1 to {MAX_STOPS} of them, got {shown(value)}")
    return tuple(many)


def token_ids(name: str, value, vocab_size: int, special=()):
    """None, a token id in the vocabulary (or one of `special`), or a non-empty list of ids."""
    if value is None or (value in special and not isinstance(value, bool)):
        return value
    many = value if isinstance(value, (list, tuple)) and value else [value]
    for v in many:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise UsageError(name, f"must be None, a token id in [0, {vocab_size}) or a list of them, "
                             f"got {shown(value)}")
    return value


def shown(value) -> str:
    """A value as an error message quotes it: at most 80 characters."""
    if isinstance(value, int) and abs(value) >= 10 ** 30:
        # (str() refuses an integer of more than sys.get_int_max_str_digits() digits)
        digits = len(str(abs(value))) if value.bit_length() < 4000 else \
            f"about {int(value.bit_length() * math.log10(2)) + 1}"
        return f"an integer of {digits} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
