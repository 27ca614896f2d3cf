"""lm-eval's model_args for flexh2o: each key checked and typed, one line naming a bad one."""

from dataclasses import dataclass, fields

from flexh2o.common.arguments import shown
from flexh2o.common.errors import UsageError
from flexh2o.engine.preflight import parse_size
from flexh2o.engine.policy import KV_POLICIES, Policy

DEFAULT_GPU_BATCH = 16


@dataclass(frozen=True)
class Settings:
    model: str
    path: str | None = None
    dtype: str | None = None           # default: the engine's (float32 on a CPU)
    device: str | None = None
    offload_dir: str | None = None     # default: flexh2o.run's
    gpu_batch_size: int | None = None  # default: lm-eval's --batch_size, else DEFAULT_GPU_BATCH
    num_gpu_batches: int = 1
    w_gpu_percent: float = 100
    w_cpu_percent: float = 0
    cache_gpu_percent: float = 100
    cache_cpu_percent: float = 0
    gpu_mem: str | None = None
    cpu_mem: str | None = None
    disk_mem: str | None = None
    max_memory: str | None = None
    kv_policy: str | None = None
    hh_ratio: float | None = None
    recent_ratio: float | None = None
    compress_weight: bool = False
    compress_cache: bool = False
    max_length: int | None = None      # default: the model's positions - 1 (see requests.py)
    max_gen_toks: int = 256            # generate_until's default, as lm-eval's hf model
    add_bos_token: bool | None = None  # None: the tokenizer's own default, as lm-eval's hf model
    truncate: bool = False             # cut over-long contexts from the left instead of refusing them
    streamed: int = 0                  # the last N context tokens fed one at a time, not prefilled
    seed: int = 0

    def policy(self, batch: int) -> Policy:
        return Policy(batch, self.num_gpu_batches, self.w_gpu_percent, self.w_cpu_percent, self.cache_gpu_percent,
                      self.cache_cpu_percent, kv_policy=self.kv_policy, hh_ratio=self.hh_ratio,
                      recent_ratio=self.recent_ratio, compress_weight=self.compress_weight,
                      compress_cache=self.compress_cache)

    def caps(self) -> dict:
        return {name: None if getattr(self, name) is None else parse_size(getattr(self, name), f"model_args {name}")
                for name in ("gpu_mem", "cpu_mem", "disk_mem", "max_memory")}


TYPES = {f.name: str(f.type) for f in fields(Settings)}  # "int | None", "<class 'bool'>"
# What lm-eval itself passes to every model, from its own flags; device and batch_size are taken.
HARNESS_KEYS = ("batch_size", "max_batch_size", "device")
ZERO_ALLOWED = ("streamed", "seed")  # the whole-number keys for which 0 means something
PERCENT_KEYS = "w_gpu_percent/w_cpu_percent/cache_gpu_percent/cache_cpu_percent"


def _typed(key: str, value, kind: str):
    flag = f"model_args {key}"
    if value is None:
        return None
    if "bool" in kind:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
        raise UsageError(flag, f"must be true or false, got {shown(value)}")
    if "int" in kind:
        try:
            number = int(str(value))
        except ValueError:  # (a number longer than Python converts, too)
            raise UsageError(flag, f"must be a whole number, got {shown(value)}") from None
        if number < 0 or (number == 0 and key not in ZERO_ALLOWED):
            raise UsageError(flag, f"must be {'0 or more' if key in ZERO_ALLOWED else 'positive'}, got {shown(value)}")
        return number
    if "float" in kind:
        try:
            return float(str(value))
        except ValueError:
            raise UsageError(flag, f"must be a number, got {shown(value)}") from None
    return str(value)


def read_settings(args: dict) -> Settings:
    """Settings from model_args (lm-eval's own batch_size and device included); refuses unknown keys,
    wrong types and policies the engine would refuse, before anything loads."""
    args = dict(args)
    batch, _, device = (args.pop(key, None) for key in HARNESS_KEYS)
    unknown = sorted(set(args) - set(TYPES))
    if unknown:
        raise UsageError(f"model_args {unknown[0]}", f"is not a flexh2o model argument; accepted: "
                         f"{', '.join(TYPES)}")
    if "model" not in args:
        raise UsageError("model_args model", "is required: a .gguf file, a Hugging Face directory, or a preset "
                         "with path=DIR")
    typed = {key: _typed(key, value, TYPES[key]) for key, value in args.items()}
    if typed.get("kv_policy") is not None and typed["kv_policy"] not in KV_POLICIES:
        raise UsageError("model_args kv_policy", f"unknown policy {typed['kv_policy']!r}; accepted: "
                         f"{', '.join(KV_POLICIES)}")
    if typed.get("device") is None and device is not None:
        typed["device"] = str(device)
    if typed.get("gpu_batch_size") is None:
        typed["gpu_batch_size"] = DEFAULT_GPU_BATCH if batch in (None, "auto") or str(batch).startswith("auto") \
            else _typed("gpu_batch_size", batch, "int")
    settings = Settings(**typed)
    try:
        settings.policy(settings.gpu_batch_size)
        settings.caps()
    except UsageError as e:  # the engine's flag names, said as the model_args that set them
        key = PERCENT_KEYS if e.flag == "--percent" else e.flag.lstrip("-").replace("-", "_")
        raise UsageError(f"model_args {key}", e.message) from None
    return settings
