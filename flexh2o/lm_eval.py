"""Command line: python -m flexh2o.lm_eval --model_args model=M[,KEY=VALUE...] --tasks T [lm_eval's flags]

lm-evaluation-harness's own `lm_eval run`, with flexh2o as the model: every request goes through
the engine's cache (evictions, compression, offloading included). Every lm_eval flag is taken as
lm_eval takes it; this command adds `--model flexh2o`, `--batch_size auto` (flexh2o's default
gpu-batch, 16) unless a batch size is given, `--device` as flexh2o chooses it (CUDA when available,
else the CPU) unless a device is given (as --device or as model_args device, not two different
ones), and the project's offline tasks (configs/tasks) as `--include_path` unless one is given.
--tasks, --limit, --num_fewshot, --output_path and model_args are checked first: a missing or unknown
task, a limit that takes no example, a negative number of shots, an output path lm-eval could not
write its results in or a bad model argument is one line. Plain `lm_eval --model flexh2o` cannot
work: lm-eval finds models only among its own modules or ones imported before it runs, so this
command imports flexh2o's first (flexh2o/harness/model.py registers it) and then runs lm-eval's
command line.

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
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import importlib
import importlib.util
import os
import signal
import sys

from flexh2o.common.arguments import shown
from flexh2o.common.errors import UsageError
from flexh2o.common.messages import say

TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tasks")


def given(argv: list, *flags) -> bool:
    return any(a in flags or a.split("=", 1)[0] in flags for a in argv)


def values(argv: list, *flags, many: bool = True, split: bool = True) -> list | None:
    """The values given to `flags` (`--flag V...` or `--flag=V`), each split at commas (unless not
    `split`: a path); None if not given. many: a flag takes every word up to the next flag (else only
    the next word)."""
    found = None
    for n, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if name not in flags:
            continue
        found = found if found is not None else []
        words = [value] if eq else []
        for word in ([] if eq else argv[n + 1:]):
            if (word.startswith("-") and not is_number(word)) or (words and not many):
                break
            words.append(word)
        found += [part.strip() for word in words for part in word.split(",")] if split else words
    return found


def is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def check_tasks_and_limit(argv: list):
    tasks = values(argv, "--tasks", "-t")
    if not tasks or not any(tasks):
        raise UsageError("--tasks", "give one or more task names (`lm-eval ls tasks` lists them; this project's "
                         "offline ones are in configs/tasks)")
    limit = values(argv, "--limit", "-L", many=False)
    if limit is not None:
        text = limit[0] if limit else ""
        try:
            number = float(text)
        except ValueError:
            number = float("nan")
        if not (number > 0 and number != float("inf")) or (number > 1 and number != int(number)):
            raise UsageError("--limit", f"takes a number of examples (1 or more) or a fraction of them (above 0, "
                             f"below 1), got {text!r}")


def check_fewshot_and_output(argv: list):
    """--num_fewshot is a count; --output_path must be a place lm-eval can write its results in. It
    writes them only at the end, and a folder it cannot make there was a warning, exit 0 and no
    results."""
    shots = values(argv, "--num_fewshot", "-f", many=False)
    if shots is not None:
        text = shots[0] if shots else ""
        if not (text.isdigit() and text.isascii()):
            raise UsageError("--num_fewshot", f"takes a whole number of examples, 0 or more, got {shown(text)}")
    path = values(argv, "--output_path", "-o", many=False, split=False)
    if path is None:
        return
    path = path[0] if path else ""
    if not path.strip():
        raise UsageError("--output_path", "is empty: give a directory, or a .json file name in one")
    # lm-eval writes NAME_<time>.json beside a .json path, and into a folder it makes under any other
    folder = os.path.dirname(os.path.abspath(path)) if path.endswith(".json") else os.path.abspath(path)
    existing = folder
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError("--output_path", f"{path}: {existing} is not a directory, so lm-eval could not write its "
                         "results there: give a directory (made where missing), or a .json file name in one")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError("--output_path", f"{path}: the directory {existing} is not writable: give a directory "
                         "you may write in")


def check_model_args(argv: list):
    """model_args read as the model will read them, before lm-eval indexes its tasks (seconds): a bad
    key or value is one line at once. Ones given in a --config file or as JSON wait for the model."""
    words = [w for w in values(argv, "--model_args", "-a") or [] if w]
    if given(argv, "--config", "-C") or not words or any("=" not in w for w in words):
        return
    batch = values(argv, "--batch_size", "-b", many=False)
    from flexh2o.harness.settings import read_settings
    read_settings({**dict(w.split("=", 1) for w in words), "batch_size": batch[0] if batch else None})


def device_argv(argv: list) -> list:
    """The arguments with one --device, the device lm-eval records and passes the model: model_args
    device (where --device is given too, the same), else --device, else flexh2o's default device."""
    model_args = values(argv, "--model_args", "-a") or []
    in_model_args = [a.split("=", 1)[1].strip() for a in model_args if a.split("=", 1)[0].strip() == "device"]
    flag = values(argv, "--device", many=False)
    if flag is not None and (len(flag) != 1 or not flag[0]):
        raise UsageError("--device", "give one device: cpu, cuda or cuda:N")
    if in_model_args:
        if flag is not None and in_model_args[-1] != flag[0]:
            raise UsageError("--device", f"is {flag[0]}, model_args device is {in_model_args[-1]}: give one of "
                             "them, or the same device in both")
        return [*without(argv, "--device"), "--device", in_model_args[-1]]
    if flag is None:
        from flexh2o.host.devices import default_device
        return [*argv, "--device", default_device()]
    return argv


def without(argv: list, flag: str) -> list:
    """argv less `flag` and its one value."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def harness_argv(argv: list) -> list:
    """lm_eval's `run` arguments for this command's."""
    if given(argv, "--model"):
        raise UsageError("--model", "this command runs lm-eval with --model flexh2o; give the model as "
                         "--model_args model=PATH")
    check_tasks_and_limit(argv)
    check_fewshot_and_output(argv)
    check_model_args(argv)
    out = ["run", "--model", "flexh2o", *device_argv(argv)]
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
        say("error: lm-eval is not installed: pip install 'flexh2o[eval]' (or lm_eval)")
        return 2
    from lm_eval.__main__ import cli_evaluate

    importlib.import_module("flexh2o.harness.model")  # registers "flexh2o" with lm-eval
    # lm-eval's bootstrap runs in a process pool that it ends with SIGTERM: its workers must die
    # quietly, not as this command's run does (one line, unwinding, offload files removed).
    os.register_at_fork(after_in_child=default_signals)
    try:
        sys.argv = ["lm_eval", *harness_argv(argv)]
        try:
            cli_evaluate()
        except ValueError as e:  # lm-eval's word for tasks it cannot find (its other errors are its own)
            if not isinstance(e, UsageError) and str(e).startswith("Tasks not found:"):
                raise UsageError("--tasks", f"unknown task(s) {str(e).split(':', 1)[1].strip()}: `lm-eval ls tasks` "
                                 "lists them; this project's offline ones are in configs/tasks") from None
            raise
    except UsageError as e:
        say(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    from flexh2o.common.signals import exit_with, run_stoppable
    exit_with(run_stoppable(main))
