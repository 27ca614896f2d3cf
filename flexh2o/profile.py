"""Command line: python -m flexh2o.profile [--device cpu|cuda] [--offload-dir D] [--force] [--quick] [--json-out F]

Measures the machine at hand into the hardware profile `local`, the speeds the cost model predicts
runs from: matrix products, attention, memory and disk bandwidths, the engine's per-layer overhead
and an evicting KV policy's bookkeeping. It is cached in $XDG_CACHE_HOME/flexh2o/hardware/local.json;
later calls print the cached profile unless --force measures again.
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.signals import stop_at_once
    stop_at_once()

import argparse
import os
import sys
import tempfile
from typing import TYPE_CHECKING

from .errors import OneLineErrorParser, UsageError
from .names import tier_label
from .optimizer.hardware import LOCAL, HardwareProfile, load_profile, local_cache_path, save_local
from .output import check_output_file, write_json_atomic

if TYPE_CHECKING:  # torch and the measurements load once the flags parsed: --help answers without them
    import torch

BUSY_SHARE = 0.15   # of the CPU taken by other processes while measuring: the figures are suspect
QUIET_SHARE = 0.05  # ... now: quiet enough to measure again


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m flexh2o.profile", description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--device", default=None, help="the device that computes: cpu, cuda or cuda:N (default: cuda "
                   "when available, else cpu)")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="directory whose disk is measured (default: $TMPDIR/flexh2o_offload); its files are removed")
    p.add_argument("--force", action="store_true", help="measure again even if a profile is cached")
    p.add_argument("--quick", action="store_true", help="small sizes: a few seconds, rough figures (for tests)")
    p.add_argument("--json-out", metavar="FILE", help="write the profile's JSON here too")
    return p


def default_offload_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "flexh2o_offload")


# -- the cache ---------------------------------------------------------------------------------

KERNEL_NAMES = {"native": "flexh2o's C kernels", "triton": "flexh2o's Triton kernel", "torch": "torch's operations"}


def cached_profile(device: "torch.device", log) -> HardwareProfile | None:
    """The cached local profile if it was measured with this kind of device; None otherwise."""
    try:
        profile = load_profile(LOCAL)
    except UsageError as e:
        log(f"note: the cached profile is unreadable ({e.message}): measuring again")
        return None
    if profile is not None and profile.device != device.type:
        log(f"note: the cached profile was measured on {profile.device}, not {device.type}: measuring again")
        return None
    if profile is not None and profile.attention_costs is None:
        log("note: the cached profile was measured by an older flexh2o (no attention calls): measuring again")
        return None
    if profile is not None and device.type in ("cpu", "cuda"):
        from .optimizer.measure import dequant_kernel
        now = dequant_kernel(device)
        if profile.dequant_kernel != now:
            log(f"note: the cached profile timed the dequantization of {KERNEL_NAMES[profile.dequant_kernel or 'torch']}, "
                f"and this run dequantizes with {KERNEL_NAMES[now]}: measuring again")
            return None
        from . import native
        if now == "native" and profile.kernels_build != native.build():
            log("note: the cached profile timed another build of flexh2o's C kernels: measuring again")
            return None
    if profile is not None and (profile.others_cpu_share or 0) > BUSY_SHARE:
        return None if quiet_now(profile.others_cpu_share, log) else profile
    return profile


def quiet_now(then: float, log) -> bool:
    """For a profile measured while other processes kept `then` of the CPU busy: whether the machine
    is quiet enough now to measure it again; if not, a note on what its predictions are worth."""
    from .machine import others_cpu_share_now
    now = others_cpu_share_now()
    if now <= QUIET_SHARE:
        log(f"note: the cached profile was measured while other processes kept {then:.0%} of the CPU busy; the "
            f"machine is quiet now ({now:.0%}): measuring again")
        return True
    log(f"note: the cached profile was measured while other processes kept {then:.0%} of the CPU busy (now "
        f"{now:.0%}): its figures may be low, and predictions off by as much (up to 30x for the per-layer "
        "overhead); the first run that finds the machine quiet measures it again, or now: "
        "python -m flexh2o.profile --force")
    return False


def measure_here(device: "torch.device", offload_dir: str, quick: bool, log) -> HardwareProfile:
    from .optimizer.measure import measure
    log(f"measuring this machine with {device.type} computing ({'a few seconds' if quick else 'about half a minute'})")
    return measure(device, offload_dir, quick=quick, log=log)


def ensure_local_profile(device, offload_dir: str, log=None, fresh: bool = False) -> HardwareProfile:
    """The cached local profile, or one measured now (and cached) when there is none for this
    device or `fresh` asks for it. `log` takes its notes (default: stderr)."""
    import torch
    from .optimizer.measure import print_to_stderr
    log = log or print_to_stderr
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    profile = None if fresh else cached_profile(device, log)
    if profile is None:
        profile = measure_here(device, offload_dir, False, log)
        try:
            save_local(profile)
        except OSError as e:
            log(f"note: the profile could not be cached ({e.strerror or e}): it is used for this run only")
    return profile


# -- the table ---------------------------------------------------------------------------------

def flops(rate: float) -> str:
    return f"{rate / 1e12:.2f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.2f} GFLOP/s"


def bandwidth(rate: float) -> str:
    return f"{rate / 1e9:.2f} GB/s"


def gigabytes(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def profile_rows(p: HardwareProfile) -> list[tuple[str, str]]:
    rows = [("source", p.source), ("device, dtype", f"{p.device}, {p.dtype}"),
            ("memory", f"{tier_label('gpu', p.device)} {gigabytes(p.gpu_mem)}, cpu {gigabytes(p.cpu_mem)}, "
                       f"disk {gigabytes(p.disk_mem)} free")]
    for dtype, table in p.matmul_flops.items():
        rows += [(f"matmul {dtype}, {count} rows", flops(rate)) for count, rate in table.items()]
    for dtype, table in (p.int4_matmul_flops or {}).items():
        rows += [(f"4-bit weights unwidened {dtype}, {count} rows", flops(rate)) for count, rate in table.items()]
    rows += [(f"prompt attention {dtype}", flops(rate)) for dtype, rate in p.attention_flops.items()]
    rows += [("decode attention reads", bandwidth(p.device_bandwidth)),
             ("decode attention on the CPU", bandwidth(p.cpu_attention_bandwidth))]
    if p.device == "cuda":
        rows += [("host to device, pinned", bandwidth(p.h2d)), ("device to host, pinned", bandwidth(p.d2h)),
                 ("host to device, pageable", bandwidth(p.h2d_pageable)),
                 ("device to host, pageable", bandwidth(p.d2h_pageable))]
    return rows + [("memcpy", bandwidth(p.memcpy)), ("disk read", bandwidth(p.disk_read)),
                   ("disk write", bandwidth(p.disk_write)), ("dequantize", f"{p.dequant / 1e9:.3f} G values/s"
                                                                + (f" ({KERNEL_NAMES[p.dequant_kernel]})" if p.dequant_kernel else "")),
                   ("layer overhead", f"{p.layer_overhead * 1e3:.3f} ms per layer call")] + attention_call_rows(p) \
        + ([("link between pipeline stages", bandwidth(p.link_bandwidth))] if p.link_bandwidth else []) \
        + [(f"process growth, {dtype}, {threads} threads", f"{nbytes / 1e6:.0f} MB beyond the projection")
           for dtype, table in (p.process_growth or {}).items() for threads, nbytes in table.items()] \
        + ([("others' CPU share meanwhile", f"{p.others_cpu_share:.0%}" + (" (busy: measured again once quiet)"
                                             if p.others_cpu_share > BUSY_SHARE else ""))]
           if p.others_cpu_share is not None else [])


def attention_call_rows(p: HardwareProfile) -> list[tuple[str, str]]:
    if p.attention_costs is None:
        return [("attention calls", "not measured")]
    per = {"prompt": "(sequence, head, query, key)", "decode": "(sequence, head, slot)"}
    return [(f"attention call, {name.replace('_', ' ')}",
             f"{fixed * 1e3:.3f} ms + {per_unit * 1e9:.3f} ns per {per[name.split('_')[0]]}")
            for name, (fixed, per_unit) in p.attention_costs.items()]


def format_profile(profile: HardwareProfile) -> str:
    rows = profile_rows(profile)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


# -- the command -------------------------------------------------------------------------------

def check_args(args):
    from .offload_dir import check_offload_dir
    from .engine import default_device, parse_device
    for flag in ("device", "offload_dir", "json_out"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise UsageError(f"--{flag.replace('_', '-')}", "is empty; give a value or leave the flag out")
    args.device = parse_device(args.device or default_device())
    args.offload_dir = args.offload_dir or default_offload_dir()
    check_offload_dir(args.offload_dir)
    if args.json_out:
        check_output_file("--json-out", args.json_out)


def run(args) -> int:
    from .optimizer.measure import print_to_stderr
    check_args(args)
    profile = None if args.force else cached_profile(args.device, print_to_stderr)
    if profile is not None:
        print(format_profile(profile))
        print(f"cached at {local_cache_path()} (use --force to measure again)")
        return write_json(args.json_out, profile)
    profile = measure_here(args.device, args.offload_dir, args.quick, print_to_stderr)
    print(format_profile(profile))
    try:
        print(f"saved to {save_local(profile)}")
    except OSError as e:
        print(f"error: cannot save the profile to {local_cache_path()}: {e.strerror or e}", file=sys.stderr)
        return 1
    return write_json(args.json_out, profile)


def write_json(path: str | None, profile: HardwareProfile) -> int:
    if path is None:
        return 0
    try:
        write_json_atomic(path, profile.to_dict())
        return 0
    except OSError as e:
        print(f"error: --json-out: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .disk import OffloadError
    try:
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OffloadError as e:
        print(f"error: --offload-dir: {e.strerror}; the measurement stopped and its files were removed",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    from .signals import run_command
    run_command(build_parser, main, heavy=("flexh2o.optimizer.measure", "flexh2o.engine"))
