"""The hardware profile `local`: measured on this machine once, cached, and measured again when it
no longer describes the machine (another device, another dequantizing kernel or C build, or taken
while the machine was busy and it is quiet now)."""

import hashlib
from typing import TYPE_CHECKING

from flexh2o.common.errors import UsageError
from flexh2o.common.messages import say
from flexh2o.common.names import duration
from flexh2o.common.output_files import write_text_atomic
from flexh2o.host.hardware import BUSY_SHARE, LOCAL, HardwareProfile, load_profile, local_cache_path, save_local

if TYPE_CHECKING:
    import torch

QUIET_SHARE = 0.05  # others' CPU share now low enough to measure a busy profile again (BUSY_SHARE)


# -- the cache ---------------------------------------------------------------------------------

KERNEL_NAMES = {"native": "flexh2o's C kernels", "triton": "flexh2o's Triton kernel", "torch": "torch's operations"}


def cached_profile(device: "torch.device", log) -> tuple[HardwareProfile | None, str | None]:
    """(the cached local profile, None) where it describes this machine as it is; else (None, why it
    is measured again). A profile measured while the machine was busy is kept, with a note, until a
    run finds it quiet."""
    try:
        profile = load_profile(LOCAL)
    except UsageError as e:
        return None, f"the cached profile is unreadable ({e.message})"
    if profile is None:
        return None, f"no profile of this machine is cached yet ({local_cache_path()})"
    why = stale(profile, device)
    if why is not None:
        return None, why
    if (profile.others_cpu_share or 0) > BUSY_SHARE:
        return quiet_now(profile, log)
    return profile, None


def stale(profile: HardwareProfile, device: "torch.device") -> str | None:
    """Why a cached profile no longer describes this machine, or None."""
    if profile.device != device.type:
        return f"the cached profile was measured on {profile.device}, not {device.type}"
    if profile.attention_costs is None:
        return "the cached profile was measured by an older flexh2o (no attention calls)"
    if device.type not in ("cpu", "cuda"):
        return None
    from flexh2o.profiling.measure import dequant_kernel
    now = dequant_kernel(device)
    if profile.dequant_kernel != now:
        return (f"the cached profile timed the dequantization of {KERNEL_NAMES[profile.dequant_kernel or 'torch']}, "
                f"and this run dequantizes with {KERNEL_NAMES[now]}")
    from flexh2o import native
    if now == "native" and profile.kernels_build != native.build():
        return "the cached profile timed another build of flexh2o's C kernels"
    return None


def quiet_now(profile: HardwareProfile, log) -> tuple[HardwareProfile | None, str | None]:
    """For a profile measured while other processes kept some of the CPU busy: (None, why) where the
    machine is quiet enough now to measure it again; else (the profile, None), with a note on what
    its predictions are worth."""
    from flexh2o.host.cpu_load import others_cpu_share
    then, now = profile.others_cpu_share, others_cpu_share()
    if now <= QUIET_SHARE:
        return None, (f"the cached profile was measured while other processes kept {then:.0%} of the CPU busy, and "
                      f"the machine is quiet now ({now:.0%})")
    if not noted_before():
        log(f"note: the cached profile was measured while other processes kept {then:.0%} of the CPU busy: its "
            "predictions may be low; python -m flexh2o.profile --force measures it again (said once)")
    return profile, None


def noted_before() -> bool:
    """Whether a run already said the cached profile was measured on a busy machine; marks it said.
    The mark is the profile file's SHA-256, so a profile measured again is flagged again."""
    path = local_cache_path()
    try:
        with open(path, "rb") as f:
            version = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return False
    try:
        with open(path + ".busy-noted", encoding="utf-8") as f:
            if f.read() == version:
                return True
    except OSError:
        pass
    try:
        write_text_atomic(path + ".busy-noted", version)
    except OSError:
        pass  # unmarked: said again next time, nothing worse
    return False


# Seconds a first measurement with the CPU computing took (python -m flexh2o.profile --force with an
# empty cache, C kernels' build included: 78 s on a 2-core AMD EPYC otherwise idle, 2026-11-28),
# announced where no earlier measurement here says better.
FIRST_CPU_SECONDS = 80.0


def expected(device: "torch.device") -> str:
    """How long a measurement is expected to take here, and on what that rests."""
    try:
        before = load_profile(LOCAL)
    except UsageError:
        before = None
    if before is not None and before.measure_seconds and before.device == device.type:
        return f"about {duration(before.measure_seconds)}, as the last one here took"
    if device.type == "cpu":
        return f"about {duration(FIRST_CPU_SECONDS)}, as a first one on a 2-core CPU took"
    return f"no earlier one here says how long (with the CPU computing: about {duration(FIRST_CPU_SECONDS)})"


def measure_here(device: "torch.device", offload_dir: str, quick: bool, log, why: str,
                 max_memory: int | None = None) -> HardwareProfile:
    """Measures, announcing it first in one line: why, and how long it is expected to take. max_memory:
    bytes the process may use (--max-memory), which the measurements are sized to."""
    from flexh2o.profiling.measure import measure
    if quick:
        log(f"note: measuring this machine roughly (--quick) with {device.type} computing ({why}): under a minute")
    else:
        log(f"note: measuring this machine with {device.type} computing ({why}): {expected(device)}; cached "
            "for later runs")
    return measure(device, offload_dir, quick=quick, log=log, max_memory=max_memory)


def ensure_local_profile(device, offload_dir: str, log=None, fresh: bool = False,
                         max_memory: int | None = None) -> HardwareProfile:
    """The cached local profile, or one measured now (and cached) when there is none for this
    device or `fresh` asks for it, within max_memory bytes (--max-memory) where given. `log` takes
    its notes (default: stderr)."""
    import torch
    from flexh2o.host.devices import default_device
    log = log or say
    device = torch.device(device or default_device())
    profile, why = (None, "a fresh profile was asked for") if fresh else cached_profile(device, log)
    if profile is None:
        profile = measure_here(device, offload_dir, False, log, why, max_memory)
        try:
            save_local(profile)
        except OSError as e:
            log(f"note: the profile could not be cached ({e.strerror or e}): it is used for this run only")
    return profile
