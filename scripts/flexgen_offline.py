"""Runs FlexGen's benchmark, `python -m flexgen.flex_opt`, on a machine without network.

    python scripts/flexgen_offline.py --model facebook/opt-6.7b --path _DUMMY_ --percent 100 0 100 0 100 0 ...

Every flag goes to flexgen.flex_opt as given; flexgen must be importable (bench_vs_flexgen.py puts
its wheel on PYTHONPATH). FlexGen 0.1.8 asks the Hugging Face hub for OPT's tokenizer only to build
its test prompt, one short sentence left-padded to --prompt-len with OPT's padding id (which its
attention mask leaves out). With dummy weights (--path _DUMMY_) the token values change nothing it
measures, so a stand-in that pads the same way takes the tokenizer's place; real weights would need
the real tokenizer to decode their output, so any other --path is refused.
"""

import runpy
import sys

OPT_PAD, OPT_BOS, OPT_VOCAB = 1, 2, 50272
FIRST_WORD_ID = 4  # ids below are OPT's special tokens


class Encoded:
    def __init__(self, input_ids: list):
        self.input_ids = input_ids


class StandInTokenizer:
    """What FlexGen's test prompt needs of a tokenizer: texts to id lists, OPT's start id first,
    padded with OPT's padding id to max_length on padding_side. A word's id is a fixed function of
    its letters (not OPT's vocabulary)."""

    def __init__(self, padding_side: str = "right"):
        self.padding_side = padding_side
        self.pad_token_id = OPT_PAD

    def encode(self, text: str) -> list:
        span = OPT_VOCAB - FIRST_WORD_ID
        return [OPT_BOS] + [FIRST_WORD_ID + sum(ord(c) * 31 ** i for i, c in enumerate(word)) % span
                            for word in text.split()]

    def __call__(self, texts, padding="max_length", max_length=None, **_):
        texts = [texts] if isinstance(texts, str) else texts
        rows = []
        for text in texts:
            ids = self.encode(text)
            if padding == "max_length" and max_length is not None:
                if len(ids) > max_length:
                    raise ValueError(f"the stand-in tokenizer got {len(ids)} tokens for max_length {max_length}")
                pads = [OPT_PAD] * (max_length - len(ids))
                ids = pads + ids if self.padding_side == "left" else ids + pads
            rows.append(ids)
        return Encoded(rows)


def stand_in(name_or_path: str, padding_side: str = "right", **_) -> StandInTokenizer:
    return StandInTokenizer(padding_side)


def dummy_path_given(argv: list) -> bool:
    for i, arg in enumerate(argv):
        if arg.startswith("--path="):
            return "_DUMMY_" in arg
        if arg == "--path":
            return i + 1 < len(argv) and "_DUMMY_" in argv[i + 1]
    return False


def main(argv: list) -> int:
    if not dummy_path_given(argv):
        print("error: --path: the stand-in tokenizer serves dummy weights only: give --path _DUMMY_", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained = staticmethod(stand_in)  # flex_opt looks it up on the class when it runs
    sys.argv = ["flexgen.flex_opt", *argv]
    runpy.run_module("flexgen.flex_opt", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
