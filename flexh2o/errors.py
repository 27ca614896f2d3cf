"""The one error type for bad input: it names the flag (or argument) and what is accepted."""


class UsageError(ValueError):
    """Bad input from the user. The CLI prints `error: <flag>: <message>` and exits with code 2."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        self.message = message
        super().__init__(f"{flag}: {message}")
