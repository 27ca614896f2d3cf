"""JSON read as data (input records, request bodies, model and tokenizer files, state files): every
way bad text makes the parse fail is one BadJson, whose message reads after the thing's name."""

import json
import sys


class BadJson(ValueError):
    """Why a text cannot be taken as JSON, as a clause: "<name> " + str(error) is the sentence."""


def parse_json(text, **options):
    """json.loads(text, **options), text a str or bytes. BadJson where the text is not JSON, is not
    UTF-8, holds an integer longer than Python converts (sys.get_int_max_str_digits(): a ValueError
    without json's position) or nests deeper than Python's recursion limit (a RecursionError)."""
    try:
        return json.loads(text, **options)
    except json.JSONDecodeError as e:
        raise BadJson(f"is not JSON ({e.msg} at character {e.pos})") from None
    except UnicodeDecodeError as e:
        raise BadJson(f"is not JSON (not UTF-8 text: byte {e.start} cannot be decoded)") from None
    except RecursionError:
        raise BadJson("is JSON nested too deeply") from None
    except ValueError as e:
        if type(e) is not ValueError:  # an options hook's own error, for its caller
            raise
        raise BadJson(f"holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
