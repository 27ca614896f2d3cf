"""The offload dir: where runs put their disk tier, each in a fresh folder of its own.

A run's folder is named after its host and process (flexh2o-run-HOST-PID-...), so a later run on
the same host removes the folders of runs whose process is gone (a SIGKILL, a power loss) and
never another host's or a live run's. The offload dir and any parents are created only when a
tensor goes to disk, each marked as made by flexh2o, and the last run that ends removes what is
empty of them. Removals run with signals deferred (see signals.py).
"""

import errno
import os
import shutil
import socket
import tempfile

from flexh2o.common.errors import UsageError
from flexh2o.common.messages import say
from flexh2o.common.signals import deferred


def default_offload_dir() -> str:
    """Where runs put their disk tier when given no --offload-dir."""
    return os.path.join(tempfile.gettempdir(), "flexh2o_offload")


def existing_ancestor(path: str) -> str:
    """`path` itself if it exists, else the nearest folder above it that does."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_offload_dir(directory: str):
    """The offload dir (or where it would be created) is writable; nothing is left behind."""
    base = existing_ancestor(directory)
    try:
        if not os.path.isdir(base):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.NamedTemporaryFile(dir=base, prefix=".flexh2o-probe-"):
            pass
    except OSError as e:
        raise UsageError("--offload-dir", f"cannot write to {directory}: {e.strerror}") from None


MADE_MARK = ".flexh2o-made"  # in a folder flexh2o created for offload files: whichever run ends last removes it
RUN_PREFIX = "flexh2o-run-"


def make_dirs(directory: str) -> list[str]:
    """Creates `directory` and its missing parents, each marked as made by flexh2o; returns the
    chain of marked folders from `directory` up (deepest first), whoever made them: runs sharing
    a new folder each remove what is empty of it when they end, so the last one leaves nothing.
    On an error, what this call created is removed again."""
    missing, path = [], os.path.abspath(directory)
    while not os.path.isdir(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    created = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue
            created.insert(0, d)
            open(os.path.join(d, MADE_MARK), "w").close()
    except OSError:
        remove_empty(created)
        raise
    chain, path = [], os.path.abspath(directory)
    while os.path.exists(os.path.join(path, MADE_MARK)):
        chain.append(path)
        path = os.path.dirname(path)
    return chain


def remove_stale_runs(offload_dir: str) -> list[str]:
    """Removes the run folders in `offload_dir` of runs on this host whose process is gone (killed
    with SIGKILL, or a machine that lost power): each folder's name holds its host and PID. A live
    run's folder, another host's, and a folder of unknown origin are never touched."""
    host, removed = _host(), []
    try:
        names = os.listdir(offload_dir)
    except OSError:
        return removed
    for name in names:
        parts = name[len(RUN_PREFIX):].rsplit("-", 2) if name.startswith(RUN_PREFIX) else []
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or _alive(int(parts[1])):
            continue
        path = os.path.join(offload_dir, name)
        with deferred():
            shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_").replace("-", "_") or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, another user's
        return True
    return True


def make_run_dir(offload_dir: str) -> tuple[str, list[str]]:
    """A fresh run folder in `offload_dir`, and the folders created for it (deepest first). A run
    that ends removes the shared offload dir when empty, maybe between our make_dirs and mkdtemp:
    tried once more then."""
    for retries in (1, 0):
        created = []
        try:
            created = make_dirs(offload_dir)
            for path in remove_stale_runs(offload_dir):
                say(f"note: removed {path}, the offload files of a run on this host whose process is gone")
            prefix = f"{RUN_PREFIX}{_host()}-{os.getpid()}-"  # whose it is, for a later run to tell if it is dead
            return tempfile.mkdtemp(prefix=prefix, dir=offload_dir), created
        except OSError as e:
            remove_empty(created)
            if not (isinstance(e, FileNotFoundError) and retries):
                raise UsageError("--offload-dir", f"cannot write to {offload_dir}: {e.strerror}") from None


def remove_empty(dirs: list[str]):
    """Removes the folders (deepest first) while they hold nothing but flexh2o's mark."""
    for d in dirs:
        mark = os.path.join(d, MADE_MARK)
        try:
            if set(os.listdir(d)) - {MADE_MARK}:
                return
            if os.path.exists(mark):
                os.unlink(mark)
            os.rmdir(d)
        except FileNotFoundError:
            continue  # another run removed it
        except OSError:
            if os.path.isdir(d):  # a run put its folder in meanwhile: the mark goes back for it
                open(mark, "a").close()
                return
