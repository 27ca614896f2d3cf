"""Command line: python -m flexh2o.profile [--device cpu|cuda] [--offload-dir D] [--force] [--quick] [--json-out F]

Measures the machine at hand into the hardware profile `local`, the speeds the cost model predicts
runs from: matrix products, attention, memory and disk bandwidths, the engine's per-layer overhead
and an evicting KV policy's bookkeeping. It is cached in $XDG_CACHE_HOME/flexh2o/hardware/local.json;
later calls print the cached profile unless --force measures again.
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import argparse

from flexh2o.common.errors import OneLineErrorParser, UsageError
from flexh2o.common.messages import say
from flexh2o.common.names import tier_label
from flexh2o.host.hardware import BUSY_SHARE, HardwareProfile, local_cache_path, save_local
from flexh2o.offload.offload_dir import default_offload_dir
from flexh2o.profiling.local_profile import KERNEL_NAMES, cached_profile, measure_here
from flexh2o.common.output_files import check_output_file, write_json_atomic

def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m flexh2o.profile", description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--device", default=None, help="the device that computes: cpu, cuda or cuda:N (default: cuda "
                   "when available, else cpu)")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="directory whose disk is measured (default: $TMPDIR/flexh2o_offload); its files are removed")
    p.add_argument("--force", action="store_true", help="measure again even if a profile is cached")
    p.add_argument("--quick", action="store_true", help="small sizes: under a minute, rough figures (for tests)")
    p.add_argument("--json-out", metavar="FILE", help="write the profile's JSON here too")
    return p


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
        rows += [(f"4-bit weights as stored {dtype}, {count} rows", flops(rate)) for count, rate in table.items()]
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
    from flexh2o.offload.offload_dir import check_offload_dir
    from flexh2o.host.devices import default_device, parse_device
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
    check_args(args)
    profile, why = (None, "--force") if args.force else cached_profile(args.device, say)
    if profile is not None:
        print(format_profile(profile))
        print(f"cached at {local_cache_path()} (use --force to measure again)")
        return write_json(args.json_out, profile)
    profile = measure_here(args.device, args.offload_dir, args.quick, say, why)
    print(format_profile(profile))
    try:
        print(f"saved to {save_local(profile)}")
    except OSError as e:
        say(f"error: cannot save the profile to {local_cache_path()}: {e.strerror or e}")
        return 1
    return write_json(args.json_out, profile)


def write_json(path: str | None, profile: HardwareProfile) -> int:
    if path is None:
        return 0
    try:
        write_json_atomic(path, profile.to_dict())
        return 0
    except OSError as e:
        say(f"error: --json-out: cannot write {path}: {e.strerror or e}")
        return 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from flexh2o.offload.disk import OffloadError
    try:
        return run(args)
    except UsageError as e:
        say(f"error: {e}")
        return 2
    except OffloadError as e:
        say(f"error: --offload-dir: {e.strerror}; the measurement stopped and its files were removed")
        return 1


if __name__ == "__main__":
    from flexh2o.common.signals import run_command
    run_command(build_parser, main, heavy=("flexh2o.profiling.measure", "flexh2o.engine.engine"))
