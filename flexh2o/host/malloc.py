"""Freed memory given back to the system, so the pre-flight's projection is what the process holds.

glibc serves an allocation from its own mapping when it is above a threshold, and by default raises
that threshold to the size of each mapped block freed (up to 32 MB); blocks under it come from
heaps that shrink only from their top. A run frees the prompt's K and V of every layer while later
allocations sit above them, so the heaps kept about one gpu-batch's prompt K and V per layer, which
no projection lists (profiling/memory_growth.py's probe, OPT-125M's widths, 12 layers, 4 gpu-batches of 12 x 256:
261-293 MB beyond the projection; 0 with the threshold fixed). A fixed threshold of 1 MB sends every
larger block to its own mapping, unmapped when freed. Measured at OPT-125M, batch 64, 128 + 32, half
the weights on disk: 138.4 and 135.0 tok/s against 135.5 and 140.0 (interleaved), peak RSS 1.50 GB
against 1.60-1.65 GB.
"""

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
THRESHOLD = 1 << 20


def fix_mmap_threshold() -> bool:
    """Fixes glibc's mmap threshold at THRESHOLD for the rest of the process; False where the C
    library has no mallopt (not glibc) or refused it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
