"""Command line: python -m flexh2o.lm_eval --model_args model=M[,KEY=VALUE...] --tasks T [lm_eval's flags]

lm-evaluation-harness's own `lm_eval run`, with flexh2o as the model: every request goes through
the engine's cache (evictions, compression, offloading included). Every lm_eval flag is taken as
lm_eval takes it; this command adds `--model flexh2o`, `--batch_size auto` (flexh2o's default
gpu-batch, 16) unless a batch size is given, and the project's offline tasks (configs/tasks) as
`--include_path` unless one is given. Plain `lm_eval --model flexh2o` cannot work: lm-eval finds
models only among its own modules or ones imported before it runs, so this command imports
flexh2o's first (flexh2o/harness/model.py registers it) and then runs lm-eval's command line.

model_args (comma-separated KEY=VALUE):
  model=M            a .gguf file, a Hugging Face directory, or a preset with path=DIR (required)
  path, dtype, device, offload_dir, seed
  gpu_batch_size, num_gpu_batches
  w_gpu_percent, w_cpu_percent, cache_gpu_percent, cache_cpu_percent   (the rest on disk)
  gpu_mem, cpu_mem, disk_mem, max_memory                               (caps, e.g. 2GB)
  kv_policy (full, h2o, local, sink, keyformer, tova), hh_ratio, recent_ratio
  compress_weight, compress_cache                                      (true/false: 4-bit groups)
  max_length         tokens of context + continuation, at most the model's positions - 1 (default)
  max_gen_toks       generate_until's default (256)
  add_bos_token      true/false: override the tokenizer's own default
  truncate           true: cut contexts that do not fit from the left (lm-eval's hf model does);
                     default: refuse them in one line
  streamed=N         the last N context tokens are fed one at a time, not prefilled, so that the
                     continuation is read from a cache that evicted while reading them

Example: python -m flexh2o.lm_eval --model_args model=models/SmolLM2-135M-Instruct.Q4_1.gguf,kv_policy=h2o,hh_ratio=0.1,recent_ratio=0.1 --tasks flexh2o_lastword
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.signals import stop_at_once
    stop_at_once()

import importlib
import importlib.util
import os
import signal
import sys

from .errors import UsageError

TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tasks")


def given(argv: list, *flags) -> bool:
    return any(a in flags or a.split("=", 1)[0] in flags for a in argv)


def harness_argv(argv: list) -> list:
    """lm_eval's `run` arguments for this command's."""
    if given(argv, "--model"):
        raise UsageError("--model", "this command runs lm-eval with --model flexh2o; give the model as "
                         "--model_args model=PATH")
    out = ["run", "--model", "flexh2o", *argv]
    if not given(argv, "--batch_size", "-b"):
        out += ["--batch_size", "auto"]
    if not given(argv, "--include_path") and os.path.isdir(TASKS_DIR):
        out += ["--include_path", TASKS_DIR]
    return out


def default_signals():
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or given(argv, "-h", "--help"):
        print(__doc__)
        return 0
    if importlib.util.find_spec("lm_eval") is None:  # the optional extra
        print("error: lm-eval is not installed: pip install 'flexh2o[eval]' (or lm_eval)", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    importlib.import_module("flexh2o.harness.model")  # registers "flexh2o" with lm-eval
    # lm-eval's bootstrap runs in a process pool that it ends with SIGTERM: its workers must die
    # quietly, not as this command's run does (one line, unwinding, offload files removed).
    os.register_at_fork(after_in_child=default_signals)
    try:
        sys.argv = ["lm_eval", *harness_argv(argv)]
        cli_evaluate()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from .signals import run_stoppable
    sys.exit(run_stoppable(main))
