"""flexh2o: high-throughput offloading inference for large language models with H2O KV eviction."""

from .engine import Engine, GenerateOutput
from .errors import UsageError
from .llm import LLM, Completion
from .policy import Policy

__all__ = ["Completion", "Engine", "GenerateOutput", "LLM", "Policy", "UsageError"]
