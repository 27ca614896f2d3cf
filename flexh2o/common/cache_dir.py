"""Where flexh2o keeps what it works out once for later runs (hardware profile, C kernels, file
hashes): $XDG_CACHE_HOME/flexh2o, ~/.cache/flexh2o by default."""

import os


def cache_dir(*parts: str) -> str:
    """The path of `parts` under flexh2o's cache directory (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexh2o", *parts)
