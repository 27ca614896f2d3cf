"""Names that command lines accept and messages use, and the flags they share, in a module free
of torch: parsers built from it answer --help at once (kv/ and the engine check the same names
where they are used)."""

import argparse

KV_POLICY_NAMES = ("full", "h2o", "local", "sink", "keyformer", "tova")
# The server's tokens per sequence where a model has more positions (llama-server's context).
DEFAULT_MAX_MODEL_LEN = 4096


def tier_label(tier: str, device_type: str) -> str:
    """A tier as messages name it: where the CPU computes, the gpu tier is the compute device's
    memory (the flags keep their names)."""
    return "compute device (CPU)" if tier == "gpu" and device_type == "cpu" else tier


def duration(seconds: float) -> str:
    """A predicted duration as people say it: 40 s, 3.5 min, 2.1 h."""
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def add_kv_flags(parser):
    """The KV policy flags every command line that runs the engine shares."""
    parser.add_argument("--kv-policy", choices=KV_POLICY_NAMES, default=None,
                        help="KV cache policy: full keeps every token (the default without --hh-ratio); the others "
                        "hold a fixed budget per sequence and head (h2o is the default with --hh-ratio)")
    parser.add_argument("--hh-ratio", type=float, default=None, metavar="R",
                        help="H2O: heavy-hitter slots = int(R * prompt_len), 0 < R <= 1; selects --kv-policy h2o")
    parser.add_argument("--recent-ratio", type=float, default=None, metavar="R",
                        help="recent-window slots = int(R * prompt_len) (default: the --hh-ratio)")


def add_model_flags(parser, default: str | None = "opt-125m"):
    """--model, --path and --dummy (default None: --model is required)."""
    parser.add_argument("--model", default=default, required=default is None,
                        help="a preset (opt-125m, opt-350m, opt-1.3b, opt-2.7b, opt-6.7b, opt-13b, opt-30b, opt-66b, "
                             "opt-175b, smollm2-135m, llama-2-7b-hf, llama-3.1-8b; also as their HF names, e.g. "
                             "facebook/opt-1.3b), a directory with an HF config.json (and safetensors or .bin "
                             "weights, a tokenizer for text), or a .gguf file (weights, config and tokenizer in one)")
    parser.add_argument("--path", help="directory holding the weights for a preset --model")
    parser.add_argument("--dummy", action="store_true",
                        help="deterministic dummy weights (the default for a preset --model without --path)")


def add_engine_flags(parser):
    """How the engine runs: the batch, the placement (planned where neither is given), the KV policy,
    compression, memory caps, device and dtype, the offload dir."""
    p = parser
    p.add_argument("--gpu-batch-size", type=int, default=None, metavar="N",
                   help="sequences per gpu-batch (default: planned, with the placement, by the cost model)")
    p.add_argument("--num-gpu-batches", type=int, default=None, metavar="N",
                   help="gpu-batches per block (default: planned, else 1)")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="when planning: the largest batch (sequences) to consider")
    p.add_argument("--allow-compression", action="store_true",
                   help="when planning: let the plan store weights and/or cache as 4-bit groups")
    p.add_argument("--percent", type=float, nargs=6, default=None,
                   metavar=("W_GPU", "W_CPU", "CACHE_GPU", "CACHE_CPU", "ACT_GPU", "ACT_CPU"),
                   help="FlexGen's six placement percentages; the rest of each kind goes to disk")
    for kind, what in (("weights", "weights"), ("cache", "the KV cache"), ("act", "activations")):
        p.add_argument(f"--{kind}", metavar="gpu=P,cpu=P,disk=P",
                       help=f"placement of {what} in percent (the same as three of --percent's numbers)")
    add_kv_flags(p)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap weight / cache I/O with compute (default: on)")
    p.add_argument("--cpu-cache-compute", action="store_true",
                   help="on CUDA, attend over a CPU-resident cache on the CPU instead of moving it")
    p.add_argument("--compress-weight", action="store_true",
                   help="store weight matrices as 4-bit groups of 64 (4.5 bits per value) on every tier")
    p.add_argument("--compress-cache", action="store_true",
                   help="store the KV cache as 4-bit groups of 64 along head_dim on every tier")
    p.add_argument("--int8-activations", action="store_true",
                   help="float32 on the CPU: multiply a GGUF file's Q4_0/Q4_1/Q8_0 matrices at few rows (decode) "
                        "with each row of activations quantized to int8, as llama.cpp does: faster, but results "
                        "differ from float32's (results/int8_activations.md)")
    for tier in ("gpu", "cpu", "disk"):
        p.add_argument(f"--{tier}-mem", metavar="SIZE", help=f"cap on the {tier} tier, e.g. 16GB (default: detected)")
    p.add_argument("--max-memory", metavar="SIZE",
                   help="memory the whole process may use, e.g. 8GB (default: the limit of its memory cgroup, if any)")
    p.add_argument("--no-page-cache", action="store_true",
                   help="disk reads skip the page cache (benchmarks measure the disk): O_DIRECT where the "
                        "filesystem allows it, else each read's pages are evicted after it, readahead off")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None,
                   help="float16 (CUDA default), bfloat16 or float32 (CPU default: a record's text then does not "
                        "depend on its batch; bfloat16 is faster on CPUs with AMX or AVX512-BF16, but its rounding "
                        "makes it depend)")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="directory for tensors placed on disk (default: $TMPDIR/flexh2o_offload)")
