"""Policy: how a generation run is shaped and where its tensors live.

Field names follow FlexGen so its users can carry their settings over. Percentages split each
kind of tensor between the compute device ("gpu"), CPU memory and disk; what is left of 100 after
the gpu and cpu shares goes to disk.
"""

from dataclasses import dataclass, asdict

from flexh2o.common.errors import UsageError
from flexh2o.kv import POLICIES

KV_POLICIES = tuple(POLICIES)


@dataclass(frozen=True)
class Policy:
    """How a run is shaped and where its tensors live (every field has a command-line flag).

    gpu_batch_size: sequences one layer call computes at once; num_gpu_batches: gpu-batches in a
        block (the block is their product: the batch generate takes).
    w_gpu_percent, w_cpu_percent: the weights' share on the compute device and in CPU memory, the
        rest on disk; cache_*: the same for the KV cache; act_*: for the hidden states between
        layers.
    overlap: load and store on I/O threads while the compute device computes.
    cpu_cache_compute: on CUDA, attend over the cache's CPU-memory share on the CPU instead of
        moving it to the GPU.
    kv_policy: "full", "h2o", "local", "sink", "keyformer" or "tova" (docs/kv-policies.md);
        None is "h2o" when hh_ratio is given, else "full".
    hh_ratio, recent_ratio: an evicting policy's heavy-hitter and recent slots per sequence, as
        shares of its prompt length (recent_ratio None: the same as hh_ratio).
    compress_weight, compress_cache: store the weights / KV cache as 4-bit groups.
    int8_activations: in a float32 run on the CPU, multiply a GGUF file's Q4_0/Q4_1/Q8_0 matrices
        with int8 activations at few rows, as llama.cpp does (compression/int8_activations.py):
        faster, results within about 1e-3 of float32's (results/int8_activations.md).
    """
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
    # KV cache: "full" keeps every token; the others hold heavy + recent slots per sequence and
    # head, heavy = int(hh_ratio * prompt_len), recent = int(recent_ratio * prompt_len).
    # kv_policy None means "h2o" when hh_ratio is given, else "full".
    kv_policy: str | None = None
    hh_ratio: float | None = None
    recent_ratio: float | None = None  # None: the same as hh_ratio
    # 4-bit group quantization (flexh2o/quant.py) of the weight matrices and of the KV cache,
    # stored compressed on every tier and dequantized right before use.
    compress_weight: bool = False
    compress_cache: bool = False
    int8_activations: bool = False

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
        self._check_kv()
        if self.compress_cache and self.cpu_cache_compute:
            raise UsageError("--compress-cache", "cannot be combined with --cpu-cache-compute (the CPU would "
                             "dequantize its whole cache at every step); give one of them")

    def _check_kv(self):
        if self.kv_policy is None:
            object.__setattr__(self, "kv_policy", "full" if self.hh_ratio is None else "h2o")
        if self.kv_policy not in KV_POLICIES:
            raise UsageError("--kv-policy", f"unknown policy {self.kv_policy!r}; accepted: {', '.join(KV_POLICIES)}")
        for flag, value in (("--hh-ratio", self.hh_ratio), ("--recent-ratio", self.recent_ratio)):
            if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise UsageError(flag, f"must be a fraction of the prompt in (0, 1], got {value!r}")
        if self.kv_policy == "full" and (self.hh_ratio is not None or self.recent_ratio is not None):
            raise UsageError("--kv-policy", "full keeps every token: --hh-ratio/--recent-ratio need an evicting "
                             "policy (h2o, local, sink, keyformer, tova)")
        if self.kv_policy != "full" and self.hh_ratio is None:
            raise UsageError("--hh-ratio", f"--kv-policy {self.kv_policy} needs a budget: give --hh-ratio "
                             "(and optionally --recent-ratio)")

    @property
    def batch_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def percents(self) -> tuple:
        """The six numbers of FlexGen's --percent, in its order."""
        return (self.w_gpu_percent, self.w_cpu_percent, self.cache_gpu_percent,
                self.cache_cpu_percent, self.act_gpu_percent, self.act_cpu_percent)

    @property
    def effective_recent_ratio(self) -> float | None:
        return self.hh_ratio if self.recent_ratio is None else self.recent_ratio

    def disk_percent(self, kind: str) -> float:
        return 100 - getattr(self, f"{kind}_gpu_percent") - getattr(self, f"{kind}_cpu_percent")

    def to_dict(self) -> dict:
        return asdict(self)


PLACEMENT_FLAGS = ("--weights", "--cache", "--act")


def parse_placement(text: str, flag: str) -> tuple[float, float]:
    """'gpu=20,cpu=80' -> (20, 80); a missing tier is 0, and disk takes what is left."""
    if not text.strip():
        raise UsageError(flag, "is empty; expected gpu=P,cpu=P,disk=P with percentages")
    shares = {}
    for item in text.split(","):
        tier, _, value = item.partition("=")
        tier = tier.strip()
        if tier in shares:
            raise UsageError(flag, f"{tier} is given twice in {text!r}")
        try:
            if tier not in ("gpu", "cpu", "disk"):
                raise ValueError(tier)
            shares[tier] = float(value)
        except ValueError:
            raise UsageError(flag, f"expected gpu=P,cpu=P,disk=P with percentages, got {text!r}") from None
        if not 0 <= shares[tier] <= 100:
            raise UsageError(flag, f"each percentage must be within 0..100, got {tier}={value.strip()}")
    gpu, cpu, disk = shares.get("gpu", 0.0), shares.get("cpu", 0.0), shares.get("disk")
    if disk is not None and abs(gpu + cpu + disk - 100) > 1e-6:
        raise UsageError(flag, f"gpu + cpu + disk must sum to 100, got {gpu + cpu + disk:g}")
    if gpu + cpu > 100:
        raise UsageError(flag, f"gpu + cpu sum to {gpu + cpu:g}, over 100")
    return gpu, cpu


def given_placements(args) -> list[str]:
    """The placement flags given on the command line."""
    given = [flag for flag in PLACEMENT_FLAGS if getattr(args, flag[2:]) is not None]
    return given + (["--percent"] if args.percent is not None else [])


def placement_flag(args) -> str | None:
    """The flag(s) a placement that does not fit is blamed on; None: the placement is automatic."""
    return "/".join(given_placements(args)) or None


def policy_percents(args) -> list[float]:
    """FlexGen's six percentages from --percent or --weights/--cache/--act (unnamed kinds: all on gpu)."""
    given = given_placements(args)
    if "--percent" in given and len(given) > 1:
        raise UsageError("--percent", "give either --percent or --weights/--cache/--act, not both")
    if args.percent is not None:
        return args.percent
    out = []
    for flag in PLACEMENT_FLAGS:
        text = getattr(args, flag[2:])
        out += parse_placement(text, flag) if text is not None else [100, 0]
    return out
