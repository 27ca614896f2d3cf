"""The throughput report: FlexGen's figures and definitions, as text and as JSON.

prefill throughput = batch * prompt_len / prefill time; decode throughput = batch * (steps - 1) /
decode time; total throughput = batch * steps / (prefill + decode time), steps being the token
steps run (gen_len unless every sequence stopped at EOS earlier). A run cut short on purpose
(--cut-gen-len) reports gen_len steps, its decode time projected from the steps it ran.
"""

import resource
import time

import torch

from flexh2o.kv import budget, cache_bytes
from flexh2o.common.version import version
from flexh2o.host.machine import describe_machine
from flexh2o.host.process_memory import read_status
from flexh2o.engine.preflight import growth_bytes, layer_bytes
from flexh2o.common.names import tier_label

GB = 1 << 30


def peak_rss() -> int:
    """This process's peak RSS in bytes: /proc's VmHWM, which starts afresh at exec. (getrusage's
    ru_maxrss keeps the launching process's peak across fork and exec: a run started from a large
    process, a test suite holding a model, reported that process's peak.)"""
    try:
        return read_status("VmHWM")
    except (OSError, RuntimeError):  # no /proc
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_memory(engine) -> dict:
    """Peak bytes per tier: what flexh2o allocated there (tracked; pinned host memory counts as
    allocated on the cpu tier), what the system saw, and what the pre-flight projected."""
    tiers, projected, limit = engine.tiers, engine.projected or {}, engine.caps.get("limit")
    rss = peak_rss()
    return {
        "peak_gpu_mem_bytes": tiers.peak["gpu"],
        "peak_gpu_allocator_bytes": torch.cuda.max_memory_allocated(tiers.compute) if tiers.on_cuda else None,
        "projected_gpu_mem_bytes": projected.get("gpu"),
        "peak_cpu_mem_bytes": tiers.peak["cpu"],
        "projected_cpu_mem_bytes": projected.get("cpu"),
        "pinned_host_bytes": tiers.pinned_bytes() if tiers.on_cuda else None,
        "peak_rss_bytes": rss,
        "peak_disk_bytes": tiers.peak["disk"],
        "memory_limit": None if limit is None else {"bytes": limit.limit, "room_bytes": limit.room, "source": limit.source},
        # The process itself: in use when the pre-flight read the free memory; what loading held
        # beyond the placed weights; what it may grow by beyond the projection (host/process_memory.py), and
        # where that figure came from; against what its peak RSS did.
        "process_at_preflight_bytes": engine.caps.get("process"),
        "load_transient_bytes": engine.load_transient,
        "weights_in_memory_bytes": engine.weight_need["gpu"] + engine.weight_need["cpu"],
        "process_growth_allowed_bytes": growth_bytes(engine.caps),
        "process_growth_source": engine.caps["growth"].source if engine.caps.get("growth") else "default",
    }


def projected_decode_seconds(step_seconds: list, gen_len: int) -> float:
    """The decode time of gen_len tokens from the token steps that ran (the prompt step first), as
    FlexGen's --cut-gen-len projects it: the first two decode steps as they ran, then the mean of
    the later ones for every step not run. Needs at least three decode steps."""
    decode = step_seconds[1:]
    if len(decode) >= gen_len - 1:
        return sum(decode)
    if len(decode) < 3:
        raise ValueError(f"projecting decode needs 3 decode steps, got {len(decode)}")
    later = decode[2:]
    return sum(decode[:2]) + sum(later) / len(later) * (gen_len - 3)


def build_report(engine, stats, policy, sample_text=None, predicted=None, generated=None,
                 cut_gen_len: int | None = None) -> dict:
    """Every figure of a run; peaks are tracked allocations per tier (the gpu tier is the compute
    device, which is the CPU itself on a machine without CUDA). cut_gen_len: the run stopped after
    that many steps on purpose; its figures are projected to stats.gen_len."""
    spec, dtype_bytes = engine.spec, torch.empty(0, dtype=engine.tiers.dtype).element_size()
    batch, steps, decode_seconds = stats.batch_size, stats.steps_done, stats.decode_seconds
    if cut_gen_len is not None:
        steps, decode_seconds = stats.gen_len, projected_decode_seconds(stats.step_seconds, stats.gen_len)
    total = stats.prefill_seconds + decode_seconds
    disk = engine.tiers.disk
    return {
        "model": spec.name,
        "weights": engine.weights_source,
        "model_sha256": engine.model_sha256,
        "device": str(engine.tiers.compute),
        "dtype": str(engine.tiers.dtype).removeprefix("torch."),
        "flexh2o_version": version(),
        "policy": policy.to_dict(),
        "batch_size": batch,
        "prompt_len": stats.prompt_len,
        "gen_len": stats.gen_len,
        "steps_done": stats.steps_done,
        "projected_from_steps": cut_gen_len,
        "model_size_bytes": sum(layer_bytes(engine.layers, dtype_bytes, policy)),
        "kv_policy": kv_description(policy, stats.prompt_len, stats.gen_len),
        "cache_size_bytes": cache_bytes(spec, policy, batch, stats.prompt_len, stats.gen_len, dtype_bytes),
        "hidden_size_bytes": spec.hidden_bytes(batch, stats.prompt_len, dtype_bytes),
        **peak_memory(engine),
        "disk_io": None if disk is None else {
            "page_cache": disk.page_cache, "bytes_read": disk.bytes_read, "bytes_written": disk.bytes_written},
        "prefill_latency_s": stats.prefill_seconds,
        "prefill_throughput": batch * stats.prompt_len / stats.prefill_seconds,
        "decode_latency_s": decode_seconds,
        "decode_throughput": batch * (steps - 1) / max(decode_seconds, 1e-10),
        "total_latency_s": total,
        "total_throughput": batch * steps / total,
        "dequant_seconds": sum(stats.step_dequant_seconds or []),  # summed over I/O threads
        "predicted": None if predicted is None else predicted.to_dict(),  # the cost model, local profile
        "sample": sample_text,
        "generated": generated,  # with a prompts file: the text each prompt got, EOS respected
        "machine": describe_machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def kv_description(policy, prompt_len: int, gen_len: int) -> str:
    capacity, recent = budget(policy, prompt_len, gen_len)
    if policy.kv_policy == "full":
        return f"full ({capacity} slots per sequence)"
    return (f"{policy.kv_policy} (hh_ratio {policy.hh_ratio:g}, recent_ratio {policy.effective_recent_ratio:g}: "
            f"{capacity} slots per sequence and head, of which {recent} recent)")


def process_line(r: dict) -> str:
    """The process's own line: RSS at the pre-flight, loading's transient, the growth allowed (and
    its source), and how far the peak RSS went beyond the projection (loading's or the run's)."""
    growth = (f"growth allowed: {r['process_growth_allowed_bytes'] / GB:.3f} GB ({r['process_growth_source']})"
              f"\tloading: {r['load_transient_bytes'] / GB:.3f} GB beyond the placed weights")
    beyond = rss_beyond_projection(r)
    if beyond is None:
        return growth
    return (f"process: {r['process_at_preflight_bytes'] / GB:.3f} GB at the pre-flight\t{growth}\t"
            f"peak RSS beyond the projection: {beyond / GB:.3f} GB")


def rss_beyond_projection(r: dict) -> int | None:
    """How far the process's peak RSS went past its RSS at the pre-flight plus the projection of host
    memory (the larger of loading's and the run's): the growth the pre-flight allowed for, as it was."""
    start = r.get("process_at_preflight_bytes")
    if start is None or r["projected_gpu_mem_bytes"] is None:
        return None
    host = ["projected_gpu_mem_bytes", "projected_cpu_mem_bytes"] if r["device"] == "cpu" else ["projected_cpu_mem_bytes"]
    loading = r["weights_in_memory_bytes"] + r["load_transient_bytes"] if r["device"] == "cpu" else 0
    return r["peak_rss_bytes"] - start - max(sum(r[k] for k in host), loading)


def format_report(r: dict) -> str:
    p = r["policy"]
    device = tier_label("gpu", r["device"])
    lines = [
        f"model: {r['model']}\tweights: {r['weights']}\tdevice: {r['device']}\tdtype: {r['dtype']}"
        + (" (the blocks' products of few rows with int8 activations)" if p.get("int8_activations") else ""),
        f"model sha256: {r['model_sha256'] or 'none (dummy weights)'}\tflexh2o: {r['flexh2o_version']}",
        f"batch: {r['batch_size']} ({p['gpu_batch_size']} x {p['num_gpu_batches']} gpu-batches)\t"
        f"prompt_len: {r['prompt_len']}\tgen_len: {r['gen_len']}"
        + (f"\t(ran {r['steps_done']} token steps; decode projected to gen_len from them, as FlexGen's "
           "--cut-gen-len does)" if r.get("projected_from_steps") else
           f"\t(all sequences hit EOS after {r['steps_done']})" if r["steps_done"] < r["gen_len"] else ""),
        f"kv cache: {r['kv_policy']}",
        f"model size: {r['model_size_bytes'] / GB:.3f} GB\tcache size: {r['cache_size_bytes'] / GB:.3f} GB\t"
        f"hidden size (p): {r['hidden_size_bytes'] / GB:.3f} GB",
        f"peak {device} mem: {r['peak_gpu_mem_bytes'] / GB:.3f} GB\tpeak cpu mem: {r['peak_cpu_mem_bytes'] / GB:.3f} GB\t"
        f"peak disk: {r['peak_disk_bytes'] / GB:.3f} GB\tprocess peak RSS: {r['peak_rss_bytes'] / GB:.3f} GB",
        f"projected {device} mem: {r['projected_gpu_mem_bytes'] / GB:.3f} GB\tprojected cpu mem: "
        f"{r['projected_cpu_mem_bytes'] / GB:.3f} GB"
        + (f"\tallocator peak: {r['peak_gpu_allocator_bytes'] / GB:.3f} GB\tpinned host: "
           f"{r['pinned_host_bytes'] / GB:.3f} GB" if r["peak_gpu_allocator_bytes"] is not None else "")
        + (f"\tmemory limit: {r['memory_limit']['bytes'] / GB:.3f} GB ({r['memory_limit']['source']})"
           if r.get("memory_limit") else ""),
        process_line(r),
        f"prefill latency: {r['prefill_latency_s']:.3f} s\tprefill throughput: {r['prefill_throughput']:.3f} token/s",
        f"decode latency: {r['decode_latency_s']:.3f} s\tdecode throughput: {r['decode_throughput']:.3f} token/s",
        f"total latency: {r['total_latency_s']:.3f} s\ttotal throughput: {r['total_throughput']:.3f} token/s",
    ]
    if r.get("predicted"):
        q = r["predicted"]
        lines.append(f"predicted (cost model, local profile): prefill {q['prefill_throughput']:.3f}, decode "
                     f"{q['decode_throughput']:.3f}, total {q['total_throughput']:.3f} token/s; measured / predicted "
                     f"total {r['total_throughput'] / q['total_throughput']:.2f}; bottleneck: prefill "
                     f"{q['bottleneck']['prefill']}, decode {q['bottleneck']['decode']}")
    if r["disk_io"]:
        d = r["disk_io"]
        lines.append(f"disk: page cache {d['page_cache']}; read {d['bytes_read'] / GB:.3f} GB, "
                     f"written {d['bytes_written'] / GB:.3f} GB")
    if r.get("generated") is not None:
        lines += [f"[{n}] {text!r}" for n, text in enumerate(r["generated"], 1)]
    elif r.get("sample") is not None:
        lines.append(f"sample: {r['sample']!r}")
    return "\n".join(lines)
