"""Command line: python -m flexh2o.run --model opt-1.3b --gpu-batch-size 8 ...

Runs one generation job and prints a FlexGen-style throughput report (and JSON with --json-out).
With no flags it runs opt-125m on dummy weights, 512 + 32 tokens, its batch and placement planned
by the cost model on this machine's profile (measured first if none is cached).
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import argparse

from flexh2o.common.names import add_engine_flags, add_model_flags
from flexh2o.common.errors import OneLineErrorParser


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m flexh2o.run", description=__doc__.split("\n\n")[1].strip())
    add_model_flags(p)
    p.add_argument("--prompt-len", type=int, default=512, metavar="N",
                   help="tokens per prompt: synthetic prompts have exactly N, --prompts-file prompts are padded to N")
    p.add_argument("--gen-len", type=int, default=32, metavar="N", help="tokens to generate per prompt")
    add_engine_flags(p)
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="when planning: a batch of exactly N sequences (--prompts-file: its prompts' count)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the synthetic prompts, dummy weights and sampling")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="with --do-sample: logits divided by T > 0 before sampling")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="with --do-sample: sample among the K likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with --do-sample: sample among the likeliest tokens whose probabilities sum to P, 0 < P <= 1")
    p.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false",
                   help="keep generating after EOS (benchmarks)")
    bench = p.add_argument_group("benchmarks measured as FlexGen measures itself (with synthetic prompts)")
    bench.add_argument("--warmup", action="store_true",
                       help="first an untimed generate of 32-token prompts and 1 new token, as FlexGen's "
                            "benchmark does")
    bench.add_argument("--cut-gen-len", type=int, metavar="N",
                       help="run N (>= 4) of --gen-len's token steps, the cache sized for all of them, and project "
                            "decode to --gen-len from them as FlexGen's --cut-gen-len does; never stops at EOS")
    p.add_argument("--json-out", metavar="FILE", help="write the report's figures, the policy and the machine as JSON here")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="UTF-8 text, one prompt per line, no blank line between prompts, each at most --prompt-len "
                        "tokens; the model needs a tokenizer (an HF directory with tokenizer files, or a GGUF). The "
                        "prompts form one batch (the planned batch, or one that --gpu-batch-size x "
                        "--num-gpu-batches equals); the generated text of each is printed. Any number of prompts: "
                        "--input")
    p.add_argument("--chat", action="store_true",
                   help="each plain prompt (--prompts-file, --input) as a user turn in the tokenizer's chat template")
    job = p.add_argument_group("dataset jobs (any number of prompts; see README)")
    job.add_argument("--input", metavar="FILE", help="prompts: plain text (one per line), JSONL ({\"id\", \"prompt\" "
                     "or \"messages\", optional max_tokens, temperature, top_p, top_k, stop, seed}) or an OpenAI "
                     "Batch file; with --gen-len as the default max_tokens")
    job.add_argument("--output", metavar="OUT.jsonl", help="one result record per input record, appended as "
                     "records finish; run the same command again to resume a stopped job")
    job.add_argument("--skip-bad", action="store_true", help="write bad input records as error records and go on "
                     "(default: refuse the input before loading the model)")
    job.add_argument("--ordered", action="store_true", help="at the end, rewrite --output in input order")
    job.add_argument("--fixed-blocks", action="store_true",
                     help="run the records in blocks sorted by length, each until its longest member stops, "
                          "instead of slots that each take the next record as soon as theirs stops")
    job.add_argument("--join-every", type=int, default=None, metavar="N",
                     help="free slots take waiting records every N token steps (default 1)")
    job.add_argument("--prompt-chunk", type=int, default=None, metavar="N",
                     help="a joining prompt longer than N tokens runs N of them per token step, so the others' "
                          "decode steps never wait for a whole long prompt (full cache, uncompressed; default: "
                          "whole prompts)")
    job.add_argument("--overwrite", action="store_true",
                     help="start --output again instead of resuming it")
    job.add_argument("--quiet", action="store_true", help="no progress bar")
    world = p.add_argument_group("more than one process (start with torchrun; see README)")
    world.add_argument("--pipeline-stages", type=int, default=1, metavar="S",
                       help="the torchrun world is S pipeline stages (each a slice of the layers) x world/S "
                            "replicas (each taking its share of --input's records); with S > 1 give "
                            "--gpu-batch-size, --num-gpu-batches and the placement")
    world.add_argument("--peer-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="a rank that gives no sign of life for this long stops every other rank")
    p.add_argument("--verbose", action="store_true", help="progress bars and more detail")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from flexh2o.cli.run_main import run_parsed  # torch and the engine load once the flags parsed: --help answers at once
    return run_parsed(args)


if __name__ == "__main__":
    from flexh2o.common.signals import run_command
    run_command(build_parser, main, heavy=("flexh2o.cli.run_main",))
