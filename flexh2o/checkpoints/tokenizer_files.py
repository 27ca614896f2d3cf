"""A model directory's tokenizer files are data: each is checked before transformers builds the
tokenizer from them, so that a broken one is one line naming the file and what is wrong, not a
KeyError from deep inside transformers."""

import os

from flexh2o.common.errors import UsageError
from flexh2o.common.json_data import BadJson, parse_json

FLAG = "--model/--path"
JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "vocab.json", "added_tokens.json")
MAX_JSON = 512 << 20


def _json(path: str):
    if os.path.getsize(path) > MAX_JSON:
        raise UsageError(FLAG, f"{path} is larger than {MAX_JSON >> 20} MB: not a tokenizer file")
    try:
        with open(path, "rb") as f:
            return parse_json(f.read())
    except BadJson as e:
        raise UsageError(FLAG, f"{path} {e}: not a tokenizer file") from None
    except OSError as e:
        raise UsageError(FLAG, f"cannot read {path}: {e.strerror}") from None


def check_tokenizer_files(directory: str):
    """Each tokenizer file present parses as what it should be: a one-line UsageError naming it otherwise."""
    for name in JSON_FILES:
        path = os.path.join(directory, name)
        if os.path.exists(path) and not isinstance(_json(path), dict):
            raise UsageError(FLAG, f"{path} is not a JSON object: not a tokenizer file")
    path = os.path.join(directory, "tokenizer.json")
    if os.path.exists(path):
        if not isinstance(_json(path), dict):
            raise UsageError(FLAG, f"{path} is not a JSON object: not a tokenizer file")
        from tokenizers import Tokenizer
        try:
            Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library's own reading of it (a Rust error, one of many kinds)
            raise UsageError(FLAG, f"{path} is not a valid tokenizer: {' '.join(str(e).split())[:200]}") from None


def load_directory_tokenizer(directory: str):
    check_tokenizer_files(directory)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # files each valid alone that do not make a tokenizer together
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise UsageError(FLAG, f"{directory}: transformers cannot build a tokenizer from its files "
                         f"({type(e).__name__}: {reason})") from None
