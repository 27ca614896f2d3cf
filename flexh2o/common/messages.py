"""Lines for the user on stderr (errors, notes, warnings), each starting on a line of its own, also
while a tqdm progress bar is drawn there: a bar leaves the cursor at the end of its own line."""

import sys

# Whether the last thing a progress bar wrote left the cursor at the end of the bar's text. A bar is
# drawn as "\r" + text and wiped with "\r" (or ended with "\n"); a signal can cut its closing short
# between the two, and tqdm then no longer lists the bar as showing.
_bar_line_open = False


def progress_bar(*args, **kwargs):
    """A tqdm bar on stderr whose writes say() can see (every bar of flexh2o's own is one)."""
    from tqdm import tqdm
    return tqdm(*args, file=_BarStream(sys.stderr), **kwargs)


class _BarStream:
    """A stream that notes whether a write left a bar's line open, then writes through."""

    def __init__(self, stream):
        self._wrapped = stream  # (the name tqdm's wrappers look for when they compare streams)

    def write(self, text: str):
        global _bar_line_open
        if text:  # noted before writing: a signal between the two costs a blank line, not a run-on one
            _bar_line_open = not text.endswith(("\n", "\r"))
        return self._wrapped.write(text)

    def __getattr__(self, name):
        return getattr(self._wrapped, name)

    def __eq__(self, other):  # tqdm.write(file=sys.stderr) clears the bars whose stream equals stderr
        return self._wrapped == getattr(other, "_wrapped", other)

    def __hash__(self):
        return hash(self._wrapped)


def say(line: str):
    """Prints `line` on stderr. Where a progress bar is showing, tqdm clears it first and draws it
    again below; where a bar's text was left on the line (its closing was cut short), the line
    starts below it. A terminal that is gone (SIGHUP) is not an error of the run."""
    global _bar_line_open
    # tqdm is looked up, not imported: where it was never imported no bar can show (and a signal
    # may land while it is half imported).
    bar_class = getattr(sys.modules.get("tqdm"), "tqdm", None)
    showing = any(not bar.disable for bar in list(getattr(bar_class, "_instances", ())))
    try:
        if showing:
            bar_class.write(line, file=sys.stderr)
            sys.stderr.flush()
        else:
            text, _bar_line_open = ("\n" if _bar_line_open else "") + line, False
            print(text, file=sys.stderr, flush=True)
    except OSError:
        pass
