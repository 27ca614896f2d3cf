"""Checks on the fields of a Hugging Face config.json that every model family shares.

Each takes `refuse(what)`, which raises the family's one-line UsageError naming the flag.
"""

import math

LARGEST = 1 << 24  # far above any real model's field (OPT-175B: 96 layers, 12288 hidden, 50272 vocab)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(config: dict, field: str, refuse, default=None) -> int:
    """config[field], a positive integer up to LARGEST; `default` where it is absent or null
    (None: the field is required)."""
    if config.get(field) is None and default is not None:
        return default
    if field not in config:
        refuse(f"config.json lacks {field}")
    value = config[field]
    if not is_int(value) or value < 1:
        refuse(f"config.json's {field} must be a positive integer, got {value!r}")
    if value > LARGEST:  # a hand-edited 10**9 layers would hang building them
        refuse(f"config.json's {field} is {value}, over {LARGEST}")
    return value


def positive_ints(config: dict, fields, refuse) -> dict:
    return {field: positive_int(config, field, refuse) for field in fields}


def positive_number(config: dict, field: str, refuse, default: float) -> float:
    value = config.get(field)
    if value is None:
        return default
    if not is_number(value) or value <= 0:
        refuse(f"config.json's {field} must be a positive number, got {value!r}")
    return float(value)


def token_id(value, field: str, vocab_size: int, refuse) -> int:
    if not is_int(value) or not 0 <= value < vocab_size:
        refuse(f"config.json's {field} must be a token id below vocab_size, got {value!r}")
    return value
