"""A plan for a job on a profile: the capacities it is searched under, and how it is shown."""

import torch

from flexh2o.engine.preflight import capacities, format_size
from flexh2o.common.names import tier_label
from flexh2o.planning.cost_model import Prediction
from flexh2o.host.hardware import LOCAL
from flexh2o.planning.search import caps_of


def plan_capacities(profile, offload_dir: str | None, gpu_mem=None, cpu_mem=None, disk_mem=None,
                    max_memory=None, dtype: str | None = None) -> dict:
    """What the search may use: on the machine at hand (the local profile) what is free now, as the
    engine's pre-flight will see it; on a named machine class its profile's sizes; caps given win."""
    if profile.name == LOCAL:
        return capacities(torch.device(profile.device), offload_dir, gpu_mem, cpu_mem, disk_mem, max_memory, dtype)
    return caps_of(profile, gpu_mem, cpu_mem, disk_mem)


def share_flag(policy, kind: str, flag: str) -> str:
    gpu, cpu = getattr(policy, f"{kind}_gpu_percent"), getattr(policy, f"{kind}_cpu_percent")
    return f"{flag} gpu={gpu:g},cpu={cpu:g},disk={100 - gpu - cpu:g}"


def run_flags(policy) -> list[str]:
    """The flexh2o.run flags that reproduce a policy."""
    flags = [f"--gpu-batch-size {policy.gpu_batch_size}", f"--num-gpu-batches {policy.num_gpu_batches}",
             share_flag(policy, "w", "--weights"), share_flag(policy, "cache", "--cache"),
             share_flag(policy, "act", "--act")]
    if policy.kv_policy != "full":
        flags += [f"--kv-policy {policy.kv_policy}", f"--hh-ratio {policy.hh_ratio:g}",
                  f"--recent-ratio {policy.effective_recent_ratio:g}"]
    switches = (("--no-overlap", not policy.overlap), ("--cpu-cache-compute", policy.cpu_cache_compute),
                ("--compress-weight", policy.compress_weight), ("--compress-cache", policy.compress_cache),
                ("--int8-activations", policy.int8_activations))
    flags += [flag for flag, on in switches if on]
    return flags


def describe_prediction(p: Prediction) -> list[str]:
    def share(phase):
        parts = p.breakdown[phase]
        total = sum(parts.values()) or 1.0
        return ", ".join(f"{what} {100 * s / total:.0f}%" for what, s in sorted(parts.items(), key=lambda kv: -kv[1]))
    return [f"predicted: prefill {p.prefill_throughput:.3f} token/s ({p.prefill_seconds:.3f} s), decode "
            f"{p.decode_throughput:.3f} token/s ({p.decode_seconds:.3f} s), total {p.total_throughput:.3f} token/s "
            f"({p.total_seconds:.3f} s)",
            f"bottleneck: prefill {p.bottleneck['prefill']} ({share('prefill')}); "
            f"decode {p.bottleneck['decode']} ({share('decode')})"]


def describe_caps(caps: dict, device_type: str) -> str:
    return ", ".join(f"{tier_label(tier, device_type)} {format_size(caps[tier])}" for tier in ("gpu", "cpu", "disk"))
