"""Names that command lines accept and messages use, in a module free of torch: parsers built
from it answer --help at once (kv/ and the engine check the same names where they are used)."""

KV_POLICY_NAMES = ("full", "h2o", "local", "sink", "keyformer", "tova")


def tier_label(tier: str, device_type: str) -> str:
    """A tier as messages name it: where the CPU computes, the gpu tier is the compute device's
    memory (the flags keep their names)."""
    return "compute device (CPU)" if tier == "gpu" and device_type == "cpu" else tier
