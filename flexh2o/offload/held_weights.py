"""Which layers' loaded weights exist at once under the zig-zag (engine/schedule.py): the layer
computing, the next one loading, and any loaded ahead with either. The buffer pool and the
pre-flight size the compute copies of weights from this."""

from collections import Counter


def loaded_with(layers, j: int) -> list[int]:
    """The layers whose weights load together with layer j's, ahead of their turn: the two after a
    lookup-only layer (an input embedding), which would otherwise wait for its lookup, which waits
    for the tokens the token step's last layer picks; the disk stood idle through the LM head's
    product (~15% of an OPT-125M decode step, weights on disk). Never the last layer itself, which
    is computing then (a pipeline stage may hold only three layers)."""
    if not layers[j].looks_up_only:
        return []
    return [j + a for a in (1, 2) if j + a < len(layers) - 1 and not layers[j + a].looks_up_only]


def held_together(layers) -> list[list[int]]:
    """For each layer j, the layers whose loaded weights exist while j computes: j, the next one
    loading, and those loaded with either (loaded_with). The pool needs a buffer of a shape for
    each holder of it in the worst of these (engine/preflight.py, compute_copy_bytes)."""
    n, groups = len(layers), []
    for j in range(n):
        group = {j, (j + 1) % n}
        for held in list(group):
            group.update(loaded_with(layers, held))
        groups.append(sorted(group))
    return groups


def most_held(counts: list[Counter], layers) -> Counter:
    """Per key, the most that any group of held_together holds at once, given each layer's counts."""
    most = Counter()
    for group in held_together(layers):
        for key, n in sum((counts[j] for j in group), Counter()).items():
            most[key] = max(most[key], n)
    return most
