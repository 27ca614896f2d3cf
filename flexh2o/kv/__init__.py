"""KV cache storage with fixed slots (and, next, the eviction policies that reuse them)."""

from .cache import KVCache

__all__ = ["KVCache"]
