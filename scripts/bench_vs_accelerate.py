"""flexh2o against Hugging Face accelerate's disk offload: same model, same memory cap, same lengths.

    python scripts/bench_vs_accelerate.py      # OPT-1.3B dummy weights, bf16, 32 + 96 tokens, cap 0.75 GB

The cap stands for the accelerator's memory (a T4's 16 GB in the H2O paper): the model's weights
(2.6 GB) do not fit it. Both engines read the same checkpoint directory, get the same disk and
the same host RAM, and neither may use the page cache for weights (flexh2o bypasses it; for
accelerate a logits processor drops the checkpoint's pages after every token step).
- accelerate (transformers `device_map="auto"`, `max_memory`, `offload_folder`): executes in the
  capped memory, so its resident weights, one streamed layer, its KV cache and its working set
  must fit the cap; it runs the largest batch that does.
- flexh2o: its compute tier is capped (`gpu_mem`), weights stream from disk, the KV cache lives in
  CPU memory (`cache cpu=100`), two gpu-batches share each weight read (hidden states of the
  waiting one in CPU memory, `act cpu=100`), and its pre-flight check admits the batch it runs.
Throughput is total tokens / (prefill + decode) time, as in FlexGen. Writes results/vs_accelerate.{json,md}.
"""

import argparse
import glob
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.machine import describe_machine  # noqa: E402
from flexh2o.memory import layer_bytes, parse_size  # noqa: E402
from flexh2o.models.opt import PRESETS  # noqa: E402
from flexh2o.prompts import synthetic_prompts  # noqa: E402
from flexh2o.output import write_json_atomic, write_text_atomic  # noqa: E402

GB = 1 << 30


def make_checkpoint(spec, directory):
    from bench_vs_transformers import hf_model
    if not os.path.exists(os.path.join(directory, "config.json")):
        hf_model(spec, 0, torch.bfloat16).save_pretrained(directory)


def drop_page_cache(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def accelerate_batch(spec, cap, resident, prompt_len, gen_len) -> int:
    """The largest batch whose KV cache and working set fit the cap next to accelerate's resident
    weights and the one offloaded layer it streams in at a time."""
    per_seq = spec.cache_bytes(1, prompt_len + gen_len, 2) + prompt_len * (3 * spec.hidden_size + spec.ffn_dim) * 2 \
        + spec.num_heads * prompt_len * prompt_len * 4 + spec.vocab_size * 4
    room = cap - resident - max(layer_bytes(spec.build_layers(), 2))
    return max(1, int(room // per_seq))


def run_accelerate(directory, batch, prompt_len, gen_len, resident, offload_dir):
    from transformers import LogitsProcessor, LogitsProcessorList, OPTForCausalLM
    model = OPTForCausalLM.from_pretrained(directory, device_map="auto", max_memory={"cpu": resident},
                                           offload_folder=offload_dir, dtype=torch.bfloat16)
    disk_modules = sum(1 for d in model.hf_device_map.values() if d == "disk")
    files = glob.glob(os.path.join(directory, "*.safetensors")) + \
        [f for f in glob.glob(os.path.join(offload_dir, "**"), recursive=True) if os.path.isfile(f)]

    class DropPages(LogitsProcessor):
        def __call__(self, ids, scores):
            drop_page_cache(files)
            return scores

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    ids, _ = synthetic_prompts(batch, prompt_len, 50272, seed=0)
    drop_page_cache(files)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, do_sample=False,
                   logits_processor=LogitsProcessorList([DropPages()]))
    seconds = time.perf_counter() - start
    return {"batch": batch, "seconds": seconds, "total_tok_s": batch * gen_len / seconds,
            "resident_weights": resident, "disk_modules": disk_modules}


def run_flexh2o(directory, gpu_batch, num_gpu_batches, prompt_len, gen_len, cap, w_gpu, offload_dir):
    # Several gpu-batches share each layer's weight read (the zig-zag block); their hidden states
    # wait in CPU memory, so the capped tier holds one gpu-batch's working set at a time.
    act_cpu = 100 if num_gpu_batches > 1 else 0
    policy = Policy(gpu_batch_size=gpu_batch, num_gpu_batches=num_gpu_batches, w_gpu_percent=w_gpu, w_cpu_percent=0,
                    cache_gpu_percent=0, cache_cpu_percent=100, act_gpu_percent=100 - act_cpu, act_cpu_percent=act_cpu)
    batch = policy.batch_size
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.bfloat16, offload_dir=offload_dir,
                                bypass_page_cache=True, gpu_mem=cap, prompt_len=prompt_len, gen_len=gen_len) as engine:
        ids, _ = synthetic_prompts(batch, prompt_len, 50272, seed=0)
        engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
        s = engine.last_stats
        seconds = s.prefill_seconds + s.decode_seconds
        return {"batch": batch, "gpu_batch": gpu_batch, "num_gpu_batches": num_gpu_batches, "seconds": seconds, "total_tok_s": batch * gen_len / seconds,
                "prefill_s": s.prefill_seconds, "decode_s": s.decode_seconds, "w_gpu_percent": w_gpu,
                "peak_gpu_tier_bytes": engine.tiers.peak["gpu"], "peak_cpu_tier_bytes": engine.tiers.peak["cpu"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--cap", default="0.75GB", help="the memory cap standing for the accelerator's memory")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--gpu-batch", type=int, default=128, help="flexh2o's gpu-batch (its pre-flight must admit it)")
    ap.add_argument("--num-gpu-batches", type=int, default=2, help="flexh2o's gpu-batches per block")
    ap.add_argument("--w-gpu", type=float, default=2)
    ap.add_argument("--acc-resident", default="0.1GB", help="accelerate's max_memory for resident weights")
    ap.add_argument("--workdir", default="/tmp/flexh2o_bench_accelerate")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "vs_accelerate"))
    args = ap.parse_args()
    spec = PRESETS[args.model]
    cap, resident = parse_size(args.cap, "--cap"), parse_size(args.acc_resident, "--acc-resident")
    checkpoint = os.path.join(args.workdir, args.model)
    make_checkpoint(spec, checkpoint)

    ours = run_flexh2o(checkpoint, args.gpu_batch, args.num_gpu_batches, args.prompt_len, args.gen_len, cap, args.w_gpu,
                       os.path.join(args.workdir, "flexh2o_offload"))
    print("flexh2o", ours, flush=True)
    acc_batch = accelerate_batch(spec, cap, resident, args.prompt_len, args.gen_len)
    theirs = run_accelerate(checkpoint, acc_batch, args.prompt_len, args.gen_len, resident,
                            os.path.join(args.workdir, "accelerate_offload"))
    print("accelerate", theirs, flush=True)
    ratio = ours["total_tok_s"] / theirs["total_tok_s"]
    result = {"command": "python " + " ".join(sys.argv), "model": args.model, "cap_bytes": cap,
              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "flexh2o": ours, "accelerate": theirs,
              "ratio": ratio, "machine": describe_machine()}
    write_json_atomic(args.out + ".json", result)
    m = result["machine"]
    lines = [f"# flexh2o vs accelerate disk offload: {args.model} dummy weights, bfloat16, "
             f"{args.prompt_len}+{args.gen_len}, memory cap {args.cap}", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}. Command: `{result['command']}`. "
             "Page cache kept out of both engines' weight reads.", "",
             "| engine | placement | batch | time s | total tok/s |", "|---|---|---|---|---|",
             f"| accelerate | {args.acc_resident} of weights resident, {theirs['disk_modules']} modules on disk, "
             f"cache in the cap | {theirs['batch']} | {theirs['seconds']:.1f} | {theirs['total_tok_s']:.2f} |",
             f"| flexh2o | weights {args.w_gpu:g}% on the capped tier, rest on disk; cache and waiting hidden states "
             f"in CPU memory | {ours['batch']} ({args.gpu_batch} x {args.num_gpu_batches} gpu-batches) | {ours['seconds']:.1f} | {ours['total_tok_s']:.2f} |", "",
             f"flexh2o / accelerate: **{ratio:.1f}x** total throughput (target >= 10x).", ""]
    write_text_atomic(args.out + ".md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
