"""Lines for the user on stderr (errors, notes, warnings), each starting on a line of its own, also
while a tqdm progress bar is drawn there: a bar leaves the cursor at the end of its own line."""

import sys


def say(line: str):
    """Prints `line` on stderr. Where a progress bar is showing, tqdm clears it first and draws it
    again below. A terminal that is gone (SIGHUP) is not an error of the run."""
    # tqdm is looked up, not imported: where it was never imported no bar can show (and a signal
    # may land while it is half imported).
    bar_class = getattr(sys.modules.get("tqdm"), "tqdm", None)
    showing = any(not bar.disable for bar in list(getattr(bar_class, "_instances", ())))
    try:
        if showing:
            bar_class.write(line, file=sys.stderr)
            sys.stderr.flush()
        else:
            print(line, file=sys.stderr, flush=True)
    except OSError:
        pass
