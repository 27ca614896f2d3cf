"""A line for the user (common/messages.py) starts on a line of its own while a progress bar is drawn
on stderr, and the bar is drawn again below it."""

import io
import re
import sys

from flexh2o.common import messages
from flexh2o.common.messages import progress_bar, say


def captured(monkeypatch) -> io.StringIO:
    """sys.stderr as a string (set in the test itself: pytest sets its own between set-up and call)."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(messages, "_bar_line_open", False)
    return stream


def test_a_line_said_while_a_bar_shows_does_not_run_on_from_the_bar(monkeypatch):
    stderr = captured(monkeypatch)
    with progress_bar(total=4, desc="job") as bar:
        bar.update(1)
        bar.refresh()
        drawn = stderr.getvalue()
        assert "1/4" in drawn and not drawn.endswith("\n")  # the cursor is at the end of the bar's line
        say("error: something failed")
        after = stderr.getvalue()
    lines = re.split(r"[\r\n]", after)
    assert "error: something failed" in lines  # cleared bar (\r), or a new line, before it
    assert not re.search(r"[^\r\n]error: something failed", after), after
    assert "1/4" in after[after.index("error: something failed"):]  # the bar, drawn again below


def test_a_bar_whose_closing_was_cut_short_leaves_the_line_to_a_new_one(monkeypatch):
    """A signal can land in tqdm's close() after it marked the bar closed and before it wiped the
    line: tqdm no longer lists the bar as showing, but its text is still there."""
    stderr = captured(monkeypatch)
    bar = progress_bar(total=2000, desc="generate", unit="step", leave=False)
    try:
        bar.refresh()
        bar.disable = True  # close()'s first step, and no more
        say("stopped by SIGINT: the run was cancelled")
        say("a second line")
    finally:
        bar.disable = False
        bar.close()
    assert "step/s]\nstopped by SIGINT: the run was cancelled\na second line\n" in stderr.getvalue()


def test_a_closed_bar_adds_no_blank_line(monkeypatch):
    stderr = captured(monkeypatch)
    with progress_bar(total=2, desc="job", leave=False) as bar:
        bar.update(2)
    say("done")
    assert stderr.getvalue().endswith("\rdone\n")


def test_without_a_bar_a_line_is_printed_as_it_is(monkeypatch):
    stderr = captured(monkeypatch)
    say("note: a note")
    with progress_bar(total=2, disable=True):
        say("error: an error")
    assert stderr.getvalue() == "note: a note\nerror: an error\n"
