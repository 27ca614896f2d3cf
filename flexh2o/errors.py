"""The one error type for bad input: it names the flag (or argument) and what is accepted."""

import argparse
import sys


class UsageError(ValueError):
    """Bad input from the user. The CLI prints `error: <flag>: <message>` and exits with code 2."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        self.message = message
        super().__init__(f"{flag}: {message}")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are one line `error: ...` (exit code 2), as every other bad input."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
