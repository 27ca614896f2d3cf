"""Hardware profiles: the speeds and memory sizes the cost model predicts a run from.

A profile is one small JSON file. The machine classes ship in configs/hardware/ (t4, a100-40g,
h100-80g), each naming its source; `local` is measured on the machine at hand by
`python -m flexh2o.profile` and cached in $XDG_CACHE_HOME/flexh2o/hardware/local.json.

Every speed is in bytes/s, FLOP/s or values/s, every size in bytes, every time in seconds.
"""

import math
import os
from dataclasses import MISSING, asdict, dataclass, fields

from flexh2o.common.arguments import shown
from flexh2o.common.cache_dir import cache_dir
from flexh2o.common.errors import UsageError
from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.common.output_files import write_json_atomic

BUSY_SHARE = 0.15   # of the CPU taken by other processes while measuring: the figures are suspect
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "configs", "hardware")
LOCAL = "local"


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str
    device: str                  # what computes: "cuda" or "cpu" (then the gpu and cpu tiers are one RAM)
    dtype: str                   # the dtype runs use on it by default (float16 on CUDA, float32 on a CPU)
    gpu_mem: int                 # bytes each tier holds
    cpu_mem: int
    disk_mem: int
    # FLOP/s of [rows, K] @ [K, N] products by rows ("1", "16", ... as JSON keys), per dtype; between
    # the rows measured the cost model interpolates in log(rows), past them it holds the end value.
    matmul_flops: dict
    attention_flops: dict        # per dtype: the prompt's attention products (Q K^T, P V), FLOP/s
    device_bandwidth: float      # bytes/s decode attention reads K and V at on the compute device
    cpu_attention_bandwidth: float  # the same on the CPU (--cpu-cache-compute)
    h2d: float                   # pinned host-to-device copies (0 where the CPU computes)
    d2h: float
    h2d_pageable: float
    d2h_pageable: float
    memcpy: float                # CPU memory to CPU memory, bytes per second an I/O thread copies
    disk_read: float             # the offload disk, bypassing the page cache
    disk_write: float
    dequant: float               # 4-bit group values dequantized per second on the compute device
    layer_overhead: float        # seconds per (layer, gpu-batch) call beyond its arithmetic and I/O
    # The engine's attention calls, each a line [fixed seconds, seconds per unit] fitted to two
    # timings (attention_costs.py); None where not measured (the shipped profiles of machines this
    # project has not run on): the cost model then goes by attention_flops and device_bandwidth.
    attention_costs: dict | None = None
    # Bytes a run's process grows by beyond the pre-flight's projection, per dtype and torch thread
    # count ({"float32": {"2": bytes}}), measured by profiling/memory_growth.py's probes; None where not measured.
    process_growth: dict | None = None
    # The share of all cores other processes kept busy while it was measured (machine.LoadMeter);
    # None where not recorded. A busy measurement is re-done once the machine is quiet (profile.py).
    others_cpu_share: float | None = None
    # What measured `dequant`: "native" (flexh2o's C kernels, flexh2o/native), "triton" (its GPU kernel,
    # gpu_dequant.py) or "torch"; None in profiles older than the kernels. A profile is measured again
    # when a run would use another.
    dequant_kernel: str | None = None
    # Which build of those kernels it timed (native.build()); a CPU profile is measured again when
    # a run loads another (new kernels: other speeds). None in older profiles, or with torch's.
    kernels_build: str | None = None
    # FLOP/s of products with a 4-bit weight multiplied as stored (kernel_choice.py), by dtype and rows up
    # to the kernel's limit; None (or a dtype missing) where no kernel takes it: the cost model then
    # charges dequantizing, then the full-width product.
    int4_matmul_flops: dict | None = None
    # Bytes/s between two pipeline stages' processes (profiling/link.py: two local processes over
    # gloo); None where not measured. Between machines it is the network's.
    link_bandwidth: float | None = None
    # Seconds the measurement took (profiling/measure.py), which the next one announces it will take;
    # None in shipped profiles and older ones.
    measure_seconds: float | None = None

    def knows(self, dtype: str) -> bool:
        """Whether the profile has matrix-product figures for runs in this dtype."""
        return dtype in self.matmul_flops and dtype in self.attention_flops

    def matmul_rate(self, rows: float, dtype: str | None = None) -> float:
        """FLOP/s of a matrix product with `rows` rows, interpolated in log(rows)."""
        return interpolated(self.matmul_flops[dtype or self.dtype], rows)

    def int4_matmul_rate(self, rows: float, dtype: str) -> float | None:
        """FLOP/s of a product with a 4-bit weight multiplied as stored, or None where not measured."""
        table = (self.int4_matmul_flops or {}).get(dtype)
        return None if table is None else interpolated(table, rows)

    def to_dict(self) -> dict:
        return asdict(self)


def interpolated(rates: dict, rows: float) -> float:
    """A table of FLOP/s by row count ({"1": rate, ...}) at `rows`, interpolated in log(rows)."""
    table = sorted((int(r), f) for r, f in rates.items())
    if rows <= table[0][0]:
        return table[0][1] * rows / table[0][0]  # below the table: bound by reading the matrix
    for (r0, f0), (r1, f1) in zip(table, table[1:]):
        if rows <= r1:
            t = math.log(rows / r0) / math.log(r1 / r0)
            return f0 + t * (f1 - f0)
    return table[-1][1]


DEVICES = ("cuda", "cpu")
DTYPES = ("float16", "bfloat16", "float32")
SPEEDS = ("device_bandwidth", "cpu_attention_bandwidth", "memcpy", "disk_read", "disk_write", "dequant")
DEQUANT_KERNELS = ("native", "triton", "torch")
COPIES = ("h2d", "d2h", "h2d_pageable", "d2h_pageable")  # 0 where the CPU computes
ATTENTION_CALLS = ("prompt_fused", "prompt_observed", "decode_fused", "decode_evicting")  # attention_costs.py


def from_dict(data: dict, where: str) -> HardwareProfile:
    names = {f.name for f in fields(HardwareProfile)}
    optional = {f.name for f in fields(HardwareProfile) if f.default is not MISSING}
    missing = sorted(names - optional - set(data))
    if missing:
        raise UsageError("--hardware", f"{where} lacks {', '.join(missing)}")
    check_fields(data, where)
    return HardwareProfile(**{k: data[k] for k in names if k in data})


def check_fields(data: dict, where: str):
    """Every field of a profile checked, as the cost model will divide by and look up in them: a
    file any process or person can edit must fail here, in one line naming the field."""
    def bad(field, why):
        raise UsageError("--hardware", f"{where}: {field} {why}")

    def number(field, value, strict=True, integer=False):
        kind = "a whole number" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            bad(field, f"must be {kind}, not {shown(value)}")
        # (an integer beyond a float's range would make isfinite raise; no figure comes near 2**1000)
        if (isinstance(value, int) and not -2 ** 1000 < value < 2 ** 1000) or not math.isfinite(value) or value < 0 \
                or (strict and value == 0):
            bad(field, f"must be {'above 0' if strict else 'at least 0'} and finite, not {shown(value)}")

    def table(field, value, dtype, rows: bool):
        if not isinstance(value, dict) or not value:
            bad(field, f"must be a non-empty table by dtype, not {shown(value)}")
        if dtype is not None and dtype not in value:
            bad(field, f"has no figures for the profile's dtype {shown(dtype)}")
        for d, entry in value.items():
            if not rows:
                number(f"{field}[{shown(d)}]", entry)
                continue
            if not isinstance(entry, dict) or not entry:
                bad(f"{field}[{shown(d)}]", f"must be a non-empty table of FLOP/s by rows, not {shown(entry)}")
            for r, rate in entry.items():
                if not (isinstance(r, str) and r.isdigit() and int(r) > 0):
                    bad(f"{field}[{shown(d)}]", f"has a row count {shown(r)} that is not a positive whole number")
                number(f"{field}[{shown(d)}][{shown(r)}]", rate)

    for field in ("name", "source"):
        if not isinstance(data[field], str):
            bad(field, f"must be a string, not {shown(data[field])}")
    if data["device"] not in DEVICES:
        bad("device", f"must be one of {', '.join(DEVICES)}, not {shown(data['device'])}")
    if data["dtype"] not in DTYPES:
        bad("dtype", f"must be one of {', '.join(DTYPES)}, not {shown(data['dtype'])}")
    for field in ("gpu_mem", "cpu_mem"):
        number(field, data[field], integer=True)
    number("disk_mem", data["disk_mem"], strict=False, integer=True)
    for field in SPEEDS:
        number(field, data[field])
    for field in COPIES:
        number(field, data[field], strict=data["device"] == "cuda")
    number("layer_overhead", data["layer_overhead"], strict=False)
    table("matmul_flops", data["matmul_flops"], data["dtype"], rows=True)
    table("attention_flops", data["attention_flops"], data["dtype"], rows=False)
    costs = data.get("attention_costs")
    if costs is not None:
        if not isinstance(costs, dict) or set(costs) != set(ATTENTION_CALLS):
            bad("attention_costs", f"must hold a line for each of {', '.join(ATTENTION_CALLS)}")
        for call, line in costs.items():
            if not isinstance(line, list) or len(line) != 2:
                bad(f"attention_costs[{shown(call)}]", f"must be [fixed seconds, seconds per unit], not {shown(line)}")
            for value in line:
                number(f"attention_costs[{shown(call)}]", value, strict=False)
    share = data.get("others_cpu_share")
    if share is not None:
        number("others_cpu_share", share, strict=False)
        if share > 1:
            bad("others_cpu_share", f"must be a share between 0 and 1, not {shown(share)}")
    if data.get("int4_matmul_flops") is not None:
        table("int4_matmul_flops", data["int4_matmul_flops"], None, rows=True)
    for field in ("link_bandwidth", "measure_seconds"):
        if data.get(field) is not None:
            number(field, data[field])
    if data.get("kernels_build") is not None and not isinstance(data["kernels_build"], str):
        bad("kernels_build", f"must be a build's name (a string), not {shown(data['kernels_build'])}")
    kernel = data.get("dequant_kernel")
    if kernel not in (None, *DEQUANT_KERNELS):
        bad("dequant_kernel", f"must be one of {', '.join(DEQUANT_KERNELS)}, not {shown(kernel)}")
    growth = data.get("process_growth")
    if growth is not None:
        if not isinstance(growth, dict):
            bad("process_growth", f"must be a table of bytes by dtype and thread count, not {shown(growth)}")
        for d, by_threads in growth.items():
            if not isinstance(by_threads, dict) or not all(isinstance(t, str) and t.isdigit() for t in by_threads):
                bad(f"process_growth[{shown(d)}]", f"must be a table of bytes by thread count, not {shown(by_threads)}")
            for t, nbytes in by_threads.items():
                number(f"process_growth[{shown(d)}][{shown(t)}]", nbytes, strict=False, integer=True)


def local_cache_path() -> str:
    return cache_dir("hardware", "local.json")


def shipped() -> list[str]:
    """The profile names in configs/hardware/."""
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def read_profile(path: str) -> HardwareProfile:
    try:
        with open(path, "rb") as f:
            data = parse_json(f.read())
    except OSError as e:
        raise UsageError("--hardware", f"cannot read {path}: {e.strerror}") from None
    except BadJson as e:
        raise UsageError("--hardware", f"{path} {e}: not a hardware profile") from None
    if not isinstance(data, dict):
        raise UsageError("--hardware", f"{path} holds no JSON object")
    return from_dict(data, path)


def load_profile(name: str) -> HardwareProfile | None:
    """A shipped profile by name, a JSON file by path, or the cached local one (None: not measured yet)."""
    if name == LOCAL:
        path = local_cache_path()
        if not os.path.exists(path):
            return None
        try:
            return read_profile(path)
        except UsageError as e:
            raise UsageError("--hardware", f"the cached local profile is broken ({e.message}); measure it again: "
                             "python -m flexh2o.profile --force") from None
    if name.endswith(".json") or os.sep in name:
        return read_profile(name)
    if name not in shipped():
        raise UsageError("--hardware", f"unknown profile {name!r}; accepted: {', '.join(shipped() + [LOCAL])} "
                         "or a path to a profile JSON")
    return read_profile(os.path.join(CONFIG_DIR, f"{name}.json"))


def save_local(profile: HardwareProfile) -> str:
    path = local_cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, profile.to_dict())
    return path
