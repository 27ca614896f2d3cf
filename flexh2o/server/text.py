"""A sequence's text as its tokens come: what may be streamed so far, and whether a stop string showed.

Tokens are decoded a few at a time (from the last point where the text was whole: a character
split over tokens shows as U+FFFD until its last byte comes), so each token costs the same
whatever the text's length. While stop strings may still show, the last (longest stop - 1)
characters are held back: a stop string that ends in a later token then cuts the text where no
character of it was sent. The final text is the dataset job's (jobs/job.py: every token decoded
at once, cut at the first stop string); finish() gives what of it is still to send.
"""


class TextTracker:
    def __init__(self, tokenizer, stops: tuple = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.start = self.read = 0  # tokens[start:read] were decoded last time, and are whole text
        self.text = ""              # the text so far (cut at a stop string, once one showed)
        self.sent = 0               # characters of it handed out
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Takes the next token; returns the text that may be sent now (often "")."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.start: self.read])
        now = self._decode(self.tokens[self.start:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            grown = len(self.text)
            self.text += now[len(before):]
            self.start, self.read = self.read, len(self.tokens)
            self._find_stop(max(0, grown - self.hold))
        safe = len(self.text) if self.stopped else len(self.text) - self.hold
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent: safe], safe
        return out

    def _find_stop(self, since: int):
        cuts = [c for c in (self.text.find(s, since) for s in self.stops) if c >= 0]
        if cuts:
            self.text, self.stopped = self.text[: min(cuts)], True

    def finish(self, final: str) -> str:
        """What of the final text is not sent yet ("" where the text sent is not its start, which
        the holding back above prevents)."""
        sent = self.text[: self.sent]
        return final[len(sent):] if final.startswith(sent) else ""
