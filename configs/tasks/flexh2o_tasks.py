"""The offline tasks' data: JSONL files next to this file (built by scripts/build_tasks.py), read
without the hub. lm-eval calls these through each task's `custom_dataset`."""

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _split(name: str) -> datasets.DatasetDict:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def lastword(**kwargs) -> datasets.DatasetDict:
    return _split("lastword.jsonl")


def cloze(**kwargs) -> datasets.DatasetDict:
    return _split("cloze.jsonl")


def first_word(resps, docs):
    """generate_until's filter: each response's first word, punctuation and spaces dropped."""
    import re
    return [[(re.match(r"\s*([A-Za-z']*)", r).group(1)) for r in rs] for rs in resps]
