"""The one error type for bad input: it names the flag (or argument) and what is accepted."""

import argparse
import os
import stat
import sys

from flexh2o.common.messages import say


class UsageError(ValueError):
    """Bad input from the user. The CLI prints `error: <flag>: <message>` and exits with code 2."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        self.message = message
        super().__init__(f"{flag}: {message}")


def check_regular_file(path: str, flag: str):
    """Refuses a path that exists but is not a regular file: opening a FIFO blocks until a writer
    comes, and a device or socket may never end. (A missing file is left to the reader to report.)"""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else \
            "not a regular file"
        raise UsageError(flag, f"{path} is {kind}, not a regular file (reading it could block the run forever)")


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each flag's line with its default, unless the text already says it or
    there is none to say (a switch that is off, a value left to the run)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or "default" in text \
                or not action.option_strings:  # nargs 0: a switch, whose help says what it turns on or off
            return text
        default = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        return f"{text} (default: {default})".lstrip()


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are one line `error: ...` (exit code 2), as every other bad input;
    its help gives each flag's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        say(f"error: {message}")
        sys.exit(2)
