"""The hardware profile `local`: measured on this machine once, cached, and measured again when it
no longer describes the machine (another device, another dequantizing kernel or C build, or taken
while the machine was busy and it is quiet now)."""

from typing import TYPE_CHECKING

from flexh2o.common.errors import UsageError
from flexh2o.host.hardware import BUSY_SHARE, LOCAL, HardwareProfile, load_profile, save_local

if TYPE_CHECKING:
    import torch

QUIET_SHARE = 0.05  # others' CPU share now low enough to measure a busy profile again (BUSY_SHARE)


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
        from flexh2o.profiling.measure import dequant_kernel
        now = dequant_kernel(device)
        if profile.dequant_kernel != now:
            log(f"note: the cached profile timed the dequantization of {KERNEL_NAMES[profile.dequant_kernel or 'torch']}, "
                f"and this run dequantizes with {KERNEL_NAMES[now]}: measuring again")
            return None
        from flexh2o import native
        if now == "native" and profile.kernels_build != native.build():
            log("note: the cached profile timed another build of flexh2o's C kernels: measuring again")
            return None
    if profile is not None and (profile.others_cpu_share or 0) > BUSY_SHARE:
        return None if quiet_now(profile.others_cpu_share, log) else profile
    return profile


def quiet_now(then: float, log) -> bool:
    """For a profile measured while other processes kept `then` of the CPU busy: whether the machine
    is quiet enough now to measure it again; if not, a note on what its predictions are worth."""
    from flexh2o.host.machine import others_cpu_share_now
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
    from flexh2o.profiling.measure import measure
    log(f"measuring this machine with {device.type} computing ({'a few seconds' if quick else 'about half a minute'})")
    return measure(device, offload_dir, quick=quick, log=log)


def ensure_local_profile(device, offload_dir: str, log=None, fresh: bool = False) -> HardwareProfile:
    """The cached local profile, or one measured now (and cached) when there is none for this
    device or `fresh` asks for it. `log` takes its notes (default: stderr)."""
    import torch
    from flexh2o.host.devices import default_device
    from flexh2o.profiling.measure import print_to_stderr
    log = log or print_to_stderr
    device = torch.device(device or default_device())
    profile = None if fresh else cached_profile(device, log)
    if profile is None:
        profile = measure_here(device, offload_dir, False, log)
        try:
            save_local(profile)
        except OSError as e:
            log(f"note: the profile could not be cached ({e.strerror or e}): it is used for this run only")
    return profile
