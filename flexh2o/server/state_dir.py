"""The server's --state-dir: files/ (the Files API) and batches/ (the Batch API), made if missing,
and a lock that one server at a time holds on it.

Every folder is made by the server or checked to be a real directory, not a link: a link planted
in place of one would send the files elsewhere. The files inside are made as a job's are (no link
followed: files.py, batches.py).
"""

import errno
import fcntl
import os
import stat

from flexh2o.common.errors import UsageError

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def real_directory(path: str) -> str:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise UsageError("--state-dir", f"cannot make {path}: {e.strerror}") from None
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise UsageError("--state-dir", f"{path} is {'a symlink' if stat.S_ISLNK(mode) else 'not a directory'}: give "
                         "a directory (or a new path)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError("--state-dir", f"{path} cannot be written")
    return path


class StateDir:
    def __init__(self, path: str):
        self.path = real_directory(os.path.abspath(path))
        self.files = real_directory(os.path.join(self.path, "files"))
        self.batches = real_directory(os.path.join(self.path, "batches"))
        lock = os.path.join(self.path, "server.lock")
        try:
            self.fd = os.open(lock, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
        except OSError as e:
            why = "is a symlink" if e.errno == errno.ELOOP else e.strerror
            raise UsageError("--state-dir", f"{lock} {why}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise UsageError("--state-dir", f"another server uses {self.path} (it holds {lock}): give each server a "
                             "state dir of its own") from None

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
