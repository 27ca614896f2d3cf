"""The flexh2o version outputs record: the installed package's version, and in a git checkout the
commit it runs from (every commit between two releases carries the same package version)."""

import functools
import os
import subprocess
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def version() -> str:
    """'0.1.0', or '0.1.0+g1a2b3c4' run from a checkout at that commit ('...-dirty' with changes
    to tracked files)."""
    try:
        base = metadata.version("flexh2o")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        base = "unknown"
    if not os.path.exists(os.path.join(ROOT, ".git")):
        return base
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):  # no git, or a very slow disk
        return base
    if commit.returncode != 0:
        return base
    return f"{base}+g{commit.stdout.strip()}" + ("-dirty" if dirty.returncode == 1 else "")
