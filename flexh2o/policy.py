"""Policy: how a generation run is shaped and where its tensors live.

Field names follow FlexGen so its users can carry their settings over. Percentages split each
kind of tensor between the compute device ("gpu"), CPU memory and disk; what is left of 100 after
the gpu and cpu shares goes to disk.
"""

from dataclasses import dataclass, asdict

from .errors import UsageError


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 4
    num_gpu_batches: int = 1
    w_gpu_percent: float = 100
    w_cpu_percent: float = 0
    cache_gpu_percent: float = 100
    cache_cpu_percent: float = 0
    act_gpu_percent: float = 100
    act_cpu_percent: float = 0
    overlap: bool = True
    cpu_cache_compute: bool = False

    def __post_init__(self):
        for name in ("gpu_batch_size", "num_gpu_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')}", f"must be a positive integer, got {value!r}")
        for kind in ("w", "cache", "act"):
            gpu, cpu = getattr(self, f"{kind}_gpu_percent"), getattr(self, f"{kind}_cpu_percent")
            for value in (gpu, cpu):
                if not 0 <= value <= 100:
                    raise UsageError("--percent", f"each percentage must be within 0..100, got {value}")
            if gpu + cpu > 100:
                raise UsageError("--percent", f"{kind} gpu + cpu percentages sum to {gpu + cpu}, over 100")

    @property
    def batch_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def percents(self) -> tuple:
        """The six numbers of FlexGen's --percent, in its order."""
        return (self.w_gpu_percent, self.w_cpu_percent, self.cache_gpu_percent,
                self.cache_cpu_percent, self.act_gpu_percent, self.act_cpu_percent)

    def disk_percent(self, kind: str) -> float:
        return 100 - getattr(self, f"{kind}_gpu_percent") - getattr(self, f"{kind}_cpu_percent")

    def to_dict(self) -> dict:
        return asdict(self)
