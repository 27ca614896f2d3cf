"""flexh2o: high-throughput offloading inference for large language models with H2O KV eviction."""

from .engine import Engine, GenerateOutput
from .errors import UsageError
from .policy import Policy

__all__ = ["Engine", "GenerateOutput", "Policy", "UsageError"]
