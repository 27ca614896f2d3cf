"""flexh2o: high-throughput offloading inference for large language models with H2O KV eviction."""

# Loaded when first asked for: `python -m flexh2o.run` imports this package before its own first
# line, which installs the signal handlers before torch loads (signals.stop_at_once).
_EXPORTS = {"Engine": "engine.engine", "GenerateOutput": "engine.engine", "UsageError": "common.errors",
            "LLM": "jobs.llm", "Completion": "jobs.llm", "Policy": "engine.policy"}
__all__ = sorted(_EXPORTS)

# Before anything large is allocated: a run's freed blocks go back to the system (malloc.py).
from flexh2o.host.malloc import fix_mmap_threshold  # noqa: E402
fix_mmap_threshold()

# Before torch loads: OpenMP reads how its threads wait once (thread_waiting.py).
from flexh2o.host.thread_waiting import choose_waiting  # noqa: E402
choose_waiting()


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flexh2o' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
