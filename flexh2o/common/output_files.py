"""Output files (--json-out, the benchmarks' results): checked before a run, written atomically.

A write goes to a temporary name in the target's directory and is renamed over the target, so a
reader never sees half a file. The rename would replace whatever is at the target, so only a
regular file or a missing path is accepted: a device (/dev/full), a FIFO, a directory or a
symlink is refused, before the run (check_output_file) and again just before the rename (what
another process puts there between that check and the rename is replaced: the check narrows the
window, it cannot close it). The file's mode follows the umask, like any file the user creates.
"""

import errno
import json
import os
import shutil
import stat
import tempfile

from flexh2o.common.errors import UsageError

MIN_FREE = 1 << 20  # bytes the target's directory must have free before the run (a report is a few KB)

KINDS = {stat.S_ISDIR: "a directory", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
         stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISLNK: "a symlink"}


def refusal(path: str) -> str | None:
    """Why `path` must not be replaced by a written file, or None (a regular file or nothing)."""
    if path.endswith(os.sep) or path.endswith("/."):
        return "names a directory (it ends in a slash): give a file name"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:  # a parent that is a file, a name too long, a folder we may not enter
        return f"cannot be written: {e.strerror}"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in KINDS.items() if test(mode)), "not a regular file")
    return f"is {kind}, which writing would replace: give a regular file or a new path"


def identity(path: str):
    """(device, inode) of the file at `path` (links followed), or None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_not_input(flag: str, path: str, inputs):
    """Refuses an output that is one of the run's input files under any spelling (`..`, a link)."""
    written = identity(path)
    for source in inputs:
        if source and written is not None and identity(source) == written:
            raise UsageError(flag, f"{path} is the input file {source} (the same file under another name): "
                             "writing it would destroy the input; give another path")


def check_output_file(flag: str, path: str, min_free: int = MIN_FREE, inputs=()):
    """Before a run: `path` can be written atomically, is none of the run's `inputs`, and its
    directory has room."""
    check_not_input(flag, path, inputs)
    reason = refusal(path)
    if reason:
        raise UsageError(flag, f"{path} {reason}")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".tmp-"):
            pass
        free = shutil.disk_usage(directory).free
    except OSError as e:
        raise UsageError(flag, f"cannot write {path}: {directory}: {e.strerror}") from None
    if free < min_free:
        raise UsageError(flag, f"cannot write {path}: {directory} has {free} bytes free")


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str, text: str):
    """Writes to a temporary name in the same directory, then renames: never a half-written file.
    Raises OSError when the target is not a regular file (or missing) or the write fails."""
    reason = refusal(path)
    if reason:
        raise OSError(errno.EEXIST, reason)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: str, data: dict):
    write_text_atomic(path, json_text(data))


def json_text(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_results(out: str, result: dict, markdown) -> None:
    """A benchmark's OUT.json and OUT.md (markdown(result)), each written atomically; prints the markdown."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_json_atomic(out + ".json", result)
    text = markdown(result)
    write_text_atomic(out + ".md", text)
    print(text)


def rewrite_markdown(out: str, markdown) -> None:
    """OUT.md again from an existing OUT.json (after a change to the markdown alone)."""
    with open(out + ".json", encoding="utf-8") as f:
        write_text_atomic(out + ".md", markdown(json.load(f)))
