"""A line for the user (common/messages.py) starts on a line of its own while a progress bar is drawn
on stderr, and the bar is drawn again below it."""

import io
import re
import sys

from tqdm import tqdm

from flexh2o.common.messages import say


def test_a_line_said_while_a_bar_shows_does_not_run_on_from_the_bar(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with tqdm(total=4, desc="job", file=sys.stderr) as bar:
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


def test_without_a_bar_a_line_is_printed_as_it_is(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    say("note: a note")
    with tqdm(total=2, file=sys.stderr, disable=True):
        say("error: an error")
    assert stderr.getvalue() == "note: a note\nerror: an error\n"
