"""Stopping a run on a signal without leaving offload files behind.

The first SIGINT, SIGTERM or SIGHUP raises `Stopped` in the main thread, so the run unwinds through
its `finally` blocks and closes its disk store. Every later signal is only noted: a second Ctrl-C
or a SIGTERM sent right after the first cannot cut that cleanup short. Code that must not be cut
at all (removing the offload directory) runs under `deferred()`, where even the first signal is
only noted. Masking with pthread_sigmask would not do: the kernel hands a process-directed signal
to any thread that leaves it unblocked (I/O threads, torch's workers), and Python then runs the
handler in the main thread anyway.
"""

import importlib
import os
import signal
import sys
import threading
from contextlib import contextmanager

from flexh2o.common.messages import say

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """Raised by the first handled signal; a KeyboardInterrupt, so `except Exception` lets it pass."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    first = None     # the first signal received, raised or noted
    raised = False   # whether a Stopped has been raised (later signals are then only noted)
    depth = 0        # nesting of deferred() sections
    closing = False  # the run has returned: signals are only noted

    def __init__(self):
        self.noted = []  # signals that arrived while the process's own handlers were borrowed
        self.outcome = None  # what the stop line says of the work kept (a dataset job: its records)
        self.reason = None  # why the run stopped itself (stop_for), where no one sent it a signal


def set_stop_outcome(describe):
    """describe() -> the part of the stop line that says what was kept and how to go on (None: the
    plain line); a dataset job says how many records are safe and the command that resumes."""
    _state.outcome = describe


_state = _State()


def kept_line() -> str:
    """What a stop line says of the work kept (set_stop_outcome's, or that the run was cancelled)."""
    return _state.outcome() if _state.outcome is not None else "the run was cancelled"


def stopped_for() -> str | None:
    """The reason stop_for gave, or None where the run was not stopped that way."""
    return _state.reason


def noted_signal() -> int | None:
    """The first signal received (one noted inside deferred() is raised only on leaving it)."""
    return _state.first


def stop_for(reason: str):
    """Stops the run from any thread as a SIGTERM would (it unwinds and removes its offload files),
    its last line the error `reason` and its exit status 1: another rank of its world failed
    (distributed.py)."""
    if _state.reason is None:
        _state.reason = reason
    os.kill(os.getpid(), signal.SIGTERM)


def _handle(signum, frame):
    if _state.first is None:
        _state.first = signum
    if _state.raised or _state.depth > 0 or _state.closing:
        return
    _state.raised = True
    raise Stopped(signum)


def _unraisable(hook_args, default=sys.unraisablehook):
    """A Stopped raised while a finalizer ran (a progress bar's __del__, collected at that moment)
    is swallowed there, with a traceback on stderr: the same signal is sent again a moment later,
    from another thread (here, its handler would run inside this hook and be swallowed too), so the
    run still stops, with its one line. `raised` stays set until that thread sends it: a signal
    landing while the thread starts (a wait, in this hook) must be noted, not raised and swallowed."""
    if isinstance(hook_args.exc_value, Stopped) and not _state.closing:
        threading.Timer(0.01, _raise_again, (hook_args.exc_value.signum,)).start()
        return
    default(hook_args)


def _raise_again(signum):
    _state.raised = False
    os.kill(os.getpid(), signum)


@contextmanager
def deferred():
    """Signals that arrive inside are noted, not raised; the first of them is raised on leaving.
    Outside the CLI (the Python API) the process's own handlers are set aside meanwhile, and what
    arrived is delivered to them on leaving."""
    outermost = _state.depth == 0
    borrowed = _borrow_handlers() if outermost else {}
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if outermost:  # an inner section must not drop what the outer one will deliver
            _give_back(borrowed)
    if _state.depth == 0 and _state.first is not None and not (_state.raised or _state.closing):
        _state.raised = True
        raise Stopped(_state.first)


def _note(signum, frame):
    _state.noted.append(signum)


def _borrow_handlers() -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    borrowed = {}
    for signum in HANDLED:
        handler = signal.getsignal(signum)
        if handler not in (_handle, None):  # None: set outside Python, cannot be put back
            borrowed[signum] = handler
            signal.signal(signum, _note)
    return borrowed


def _give_back(borrowed: dict):
    for signum, handler in borrowed.items():
        signal.signal(signum, handler)
    arrived = [s for s in dict.fromkeys(_state.noted) if s in borrowed]
    _state.noted.clear()
    for signum in arrived:
        signal.raise_signal(signum)


def stop_at_once():
    """For a command's first line, before its heavy imports: until run_stoppable takes over, a
    signal ends the process at once with its one line and 128 + signum (nothing has been written
    yet), instead of a traceback out of an import. A signal ignored at start stays ignored."""
    def stop(signum, frame):
        say(f"stopped by {signal.Signals(signum).name}: the run was cancelled before it started")
        os._exit(128 + signum)
    _install(stop)


def _install(handler):
    """handler for every handled signal not ignored at start (SIGHUP under nohup stays ignored)."""
    for signum in HANDLED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, handler)


def run_command(build_parser, main, heavy: tuple):
    """A command's `__main__`, after stop_at_once(): --help and bad flags answer from the parser
    before torch loads; then the `heavy` modules load while a signal still ends the process at once
    (under run_stoppable's handlers, its one exception could land inside an import and be swallowed
    there); then main() runs stoppable, and its code is the exit status."""
    build_parser().parse_args()
    for module in heavy:
        importlib.import_module(module)
    exit_with(run_stoppable(main))


def exit_with(code: int | None):
    """sys.exit(code), except where a run that stopped or failed still has other threads: it has
    removed its files by now, and it leaves at once with its output flushed. A helper thread may
    still be inside a native call (a receive from a pipeline stage that died, a read, a matmul); one
    that returns from it while Python shuts down is ended by pthread_exit, which aborts the process
    ("terminate called without an active exception", SIGABRT instead of the run's own status)."""
    if code and threading.active_count() > 1:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def run_stoppable(main) -> int:
    """Runs main() -> exit code with the handlers installed. A signal ends it with one line on
    stderr and exit code 128 + signum (130 for Ctrl-C). A signal ignored when the run starts
    (SIGHUP under nohup) stays ignored; one that comes after main() returned changes nothing."""
    if threading.current_thread() is threading.main_thread():
        _install(_handle)
        sys.unraisablehook = _unraisable
    code = None
    # Only one Stopped is ever raised: it is caught here wherever it lands, also after main()
    # returned and before `closing` is set, so it never escapes as a traceback.
    try:
        try:
            code = main()
        finally:
            _state.closing = True
    except Stopped:
        pass
    finally:
        _ignore_from_now()
    if code is not None or _state.first is None:
        return code
    kept = kept_line()
    if _state.reason is not None:
        say(f"error: {_state.reason}; this rank stopped: {kept} and its offload files removed")
        return 1
    say(f"stopped by {signal.Signals(_state.first).name}: {kept} and its offload files removed")
    return 128 + _state.first


def _ignore_from_now():
    """The run is over and its files removed. Python puts the default handlers back while it shuts
    down, and a late signal would then kill the process with the wrong exit code."""
    if threading.current_thread() is threading.main_thread():
        for signum in HANDLED:
            signal.signal(signum, signal.SIG_IGN)
