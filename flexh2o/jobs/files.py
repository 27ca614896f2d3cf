"""The files a dataset job writes, made safely.

Every name the job writes (--output, its settings beside it, its lock, --json-out) is checked
before anything is written: none may be the input file under another spelling (`..`, a hard
link), and none may be a symlink, a directory, a FIFO or a device (output.refusal). Files are
opened without following a link (O_NOFOLLOW), new ones created exclusively (O_EXCL), and whole
rewrites go to a fresh temporary name (mkstemp) renamed into place, so a link planted beside the
output is never written through. The temporary name starts with the file's own (`.OUT.tmp-` and 8
random characters), so a job holding the output's lock knows that such a file beside it was left
by a rewrite a SIGKILL stopped, and removes it. A failed write (a full disk, a file-size limit, an
I/O error) becomes WriteFailed, which the command prints as one line naming the path and the cause.
"""

import errno
import fcntl
import os
import re
import stat
import tempfile

from flexh2o.common.errors import UsageError
from flexh2o.common.output_files import check_not_input, current_umask, refusal
from flexh2o.common.signals import deferred

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class WriteFailed(Exception):
    """A write to one of the job's files failed; what was written before it is kept whole."""

    def __init__(self, path: str, error: OSError):
        self.path, self.cause = path, error.strerror or str(error)
        super().__init__(f"cannot write {path}: {self.cause}")


def check_written_names(flag: str, paths: list[str], input_path: str | None):
    """Before anything is written: no name in `paths` (the files a flag's output makes) is the
    input file, and each is a regular file or missing."""
    for path in paths:
        check_not_input(flag, path, [input_path])
        reason = refusal(path)
        if reason:
            raise UsageError(flag, f"{path} {reason}")


def open_for_append(path: str, create: bool) -> int:
    """A write descriptor appending to `path`: a new empty file (create), or the existing one; a
    link at the name is refused by the kernel (ELOOP), anything but a regular file here."""
    flags = os.O_WRONLY | os.O_APPEND | NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EEXIST, errno.EISDIR, errno.ENXIO):
            raise UsageError("--output", f"{path} {refusal(path) or 'appeared while the job started'}") from None
        raise WriteFailed(path, e) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError("--output", f"{path} is not a regular file: give a regular file or a new path")
    return fd


def temporary_prefix(path: str) -> str:
    return "." + os.path.basename(path) + ".tmp-"


def left_temporary_files(path: str) -> list[str]:
    """The temporary files of rewrites of `path` that are still beside it (mkstemp's 8 characters
    after temporary_prefix): left by a killed rewrite, once no job holds the output's lock."""
    directory = os.path.dirname(os.path.abspath(path))
    name = re.compile(re.escape(temporary_prefix(path)) + "[a-z0-9_]{8}")
    try:
        return sorted(os.path.join(directory, n) for n in os.listdir(directory) if name.fullmatch(n))
    except OSError:
        return []


def remove_left_temporary_files(paths: list[str]):
    """Best effort: a file that cannot be removed only takes room."""
    for path in paths:
        for left in left_temporary_files(path):
            try:
                os.unlink(left)
            except OSError:
                pass


def write_lines_atomic(path: str, lines) -> int:
    """path <- the lines (str, each ending in a newline), through a fresh temporary file in its
    directory renamed into place; a failure or a signal leaves `path` as it was and no temporary
    file (a SIGKILL leaves one, which left_temporary_files finds). Returns how many lines."""
    tmp, f, written = None, None, 0
    try:
        with deferred():  # a signal between the file's creation and `tmp` naming it would leave it behind
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=temporary_prefix(path))
            f = os.fdopen(fd, "w", encoding="utf-8")
        with f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            for line in lines:
                f.write(line)
                written += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        if isinstance(e, OSError):
            raise WriteFailed(path, e) from None
        raise
    return written


class OutputLock:
    """An exclusive lock on OUT.lock while a job writes OUT: a second job on the same output is
    refused at once instead of writing its records twice. The kernel drops the lock when the
    process ends, however it ends; the file itself stays (removing it would race a waiting job)."""

    def __init__(self, output: str, flag: str = "--output"):
        self.path = output + ".lock"
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise UsageError(flag, f"{self.path} {refusal(self.path)}") from None
            raise WriteFailed(self.path, e) from None
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise UsageError(flag, f"{self.path} is not a regular file: remove it")
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise UsageError(flag, f"{output} is being written by another job right now (it holds {self.path}); "
                             "wait for it to finish, or give another --output") from None
        except BaseException:
            os.close(self.fd)
            raise

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
