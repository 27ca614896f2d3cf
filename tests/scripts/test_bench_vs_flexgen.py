"""scripts/bench_vs_flexgen.py and scripts/flexgen_offline.py on the CPU: the two engines' command
lines, FlexGen's log and flexh2o's report read back, the tokenizer stand-in, the wheel directory,
the runs and their table (with stand-in engines), and the exit without CUDA."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_vs_flexgen as vs  # noqa: E402
from flexgen_offline import StandInTokenizer, dummy_path_given  # noqa: E402
from flexh2o.common.errors import UsageError  # noqa: E402
from flexh2o.run import build_parser  # noqa: E402
from flexh2o.cli.run_main import check_benchmark_flags  # noqa: E402

# FlexGen 0.1.8's benchmark log (flexgen/utils.py write_benchmark_log), two runs appended to one file.
LOG = """model size: 12.386 GB\tcache size: 8.500 GB\thidden size (p): 0.125 GB
peak gpu mem: 22.000 GB\tprojected: False
prefill latency: 9.000 s\tprefill throughput: 1.000 token/s
decode latency: 9.000 s\tdecode throughput: 1.000 token/s
total latency: 9.000 s\ttotal throughput: 1.000 token/s
model size: 12.386 GB\tcache size: 8.500 GB\thidden size (p): 0.125 GB
peak gpu mem: 23.456 GB\tprojected: True
prefill latency: 2.500 s\tprefill throughput: 6553.600 token/s
decode latency: 0.600 s\tdecode throughput: 1653.333 token/s
total latency: 3.100 s\ttotal throughput: 330.323 token/s
"""


def flag_values(cmd: list) -> dict:
    """--flag -> its values (a switch: []), for both engines' command lines."""
    out, key = {}, None
    for arg in cmd:
        if arg.startswith("--"):
            key = arg
            out[key] = []
        elif key:
            out[key].append(arg)
    return out


@pytest.mark.parametrize("setting", vs.SETTINGS, ids=lambda s: s.name)
def test_both_engines_get_the_same_placement_batch_and_lengths(setting):
    fx = vs.flexh2o_command(setting, "out.json", "python")
    args = build_parser().parse_args(fx[3:])
    check_benchmark_flags(args, distributed=False)
    assert args.warmup and not args.stop_at_eos and args.dtype == "float16" and args.device == "cuda"
    assert (args.model, args.gpu_batch_size, args.num_gpu_batches) == (setting.model, setting.gpu_batch_size,
                                                                        setting.num_gpu_batches)
    assert tuple(args.percent) == setting.percent and args.hh_ratio == setting.hh_ratio
    if setting.hh_ratio is not None:  # FlexGen has no H2O: its figure is an earlier setting's
        with pytest.raises(ValueError):
            vs.flexgen_command(setting, "log", "dir")
        assert setting.compare_to in [s.name for s in vs.SETTINGS]
        return
    fg = flag_values(vs.flexgen_command(setting, "run.log", "/tmp/off", "python"))
    for flag in ("--percent", "--gpu-batch-size", "--num-gpu-batches", "--prompt-len", "--gen-len",
                 "--cpu-cache-compute"):
        assert fg.get(flag) == flag_values(fx).get(flag), flag
    assert fg["--model"] == [f"facebook/{setting.model}"] and fg["--path"] == ["_DUMMY_"]
    assert fg["--log-file"] == ["run.log"] and fg["--offload-dir"] == ["/tmp/off"]


def test_the_settings_are_the_issues():
    six, thirty, h2o = vs.SETTINGS
    assert (six.model, six.percent, six.batch, six.prompt_len, six.gen_len) == \
        ("opt-6.7b", (100, 0, 100, 0, 100, 0), 32, 512, 32)
    assert (thirty.model, thirty.percent, thirty.cpu_cache_compute) == ("opt-30b", (0, 100, 0, 100, 100, 0), True)
    assert h2o.batch > thirty.batch and h2o.percent == thirty.percent and h2o.compare_to == thirty.name


def test_flexgen_log_last_run_counts():
    figures = vs.parse_flexgen_log(LOG)
    assert figures["prefill_latency_s"] == 2.5 and figures["total_throughput"] == 330.323
    assert figures["decode_throughput"] == 1653.333 and figures["peak_gpu_mem_gb"] == 23.456 and figures["projected"]
    with pytest.raises(ValueError, match="decode"):
        vs.parse_flexgen_log("\n".join(line for line in LOG.splitlines() if not line.startswith("decode")))


def test_flexh2o_report_figures():
    report = {k: float(i + 1) for i, k in enumerate(vs.FIGURES)}
    report.update(peak_gpu_allocator_bytes=3 << 30, peak_gpu_mem_bytes=1, projected_from_steps=None)
    figures = vs.flexh2o_figures(report)
    assert figures["total_throughput"] == 6.0 and figures["peak_gpu_mem_gb"] == 3.0 and not figures["projected"]


def test_the_tokenizer_stand_in_pads_as_flexgen_asks():
    tok = StandInTokenizer(padding_side="left")
    ids = tok(["Paris is the capital city of"], padding="max_length", max_length=32).input_ids
    assert len(ids) == 1 and len(ids[0]) == 32
    assert ids[0][:25] == [1] * 25 and ids[0][25] == 2 and all(4 <= t < 50272 for t in ids[0][26:])
    right = StandInTokenizer()(["Paris is"], padding="max_length", max_length=5).input_ids[0]
    assert right[:3] == ids[0][25:28] and right[3:] == [1, 1]
    with pytest.raises(ValueError):
        tok(["one two three"], padding="max_length", max_length=2)
    assert dummy_path_given(["--path", "_DUMMY_"]) and dummy_path_given(["--path=x/_DUMMY_"])
    assert not dummy_path_given(["--path", "~/opt_weights"]) and not dummy_path_given([])


def fake_flexgen(tmp_path) -> str:
    """A directory holding a `flexgen.flex_opt` that does what FlexGen's does with its tokenizer."""
    package = tmp_path / "fake" / "flexgen"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "flex_opt.py").write_text(
        "import json, sys\nfrom transformers import AutoTokenizer\n"
        "if __name__ == '__main__':\n"
        "    tok = AutoTokenizer.from_pretrained('facebook/opt-30b', padding_side='left')\n"
        "    ids = tok(['Paris is the capital city of'], padding='max_length', max_length=9).input_ids\n"
        "    print(json.dumps({'argv': sys.argv[1:], 'ids': ids}))\n")
    return str(tmp_path / "fake")


def test_the_wrapper_runs_flex_opt_with_the_stand_in_and_refuses_real_weights(tmp_path):
    env = dict(os.environ, PYTHONPATH=fake_flexgen(tmp_path), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, vs.WRAPPER, "--path", "_DUMMY_", "--gen-len", "8"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["argv"] == ["--path", "_DUMMY_", "--gen-len", "8"]
    assert len(seen["ids"][0]) == 9 and seen["ids"][0][:3] == [1, 1, 2]  # two pads on the left, then OPT's start
    r = subprocess.run([sys.executable, vs.WRAPPER, "--path", "/weights"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == \
        "error: --path: the stand-in tokenizer serves dummy weights only: give --path _DUMMY_"


def test_the_wheel_dir(tmp_path):
    (tmp_path / "attrs-26.1.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(UsageError, match="^--flexgen-wheel-dir: .* holds no flexgen-"):
        vs.flexgen_pythonpath(str(tmp_path), installed=lambda: False)
    assert vs.flexgen_pythonpath(str(tmp_path), installed=lambda: True) == []
    (tmp_path / "flexgen-0.1.8-py3-none-any.whl").write_bytes(b"")
    assert [os.path.basename(w) for w in vs.flexgen_pythonpath(str(tmp_path), installed=lambda: False)] == \
        ["attrs-26.1.0-py3-none-any.whl", "flexgen-0.1.8-py3-none-any.whl"]
    with pytest.raises(UsageError, match="is not a directory"):
        vs.flexgen_pythonpath(str(tmp_path / "none"), installed=lambda: False)


FAKE_ENGINES = """#!{python}
# Both engines as bench_vs_flexgen calls them: FlexGen through its wrapper, flexh2o as -m flexh2o.run.
import json, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
if "--gpu-batch-size" in args and value("--gpu-batch-size") == "{failing_batch}":
    sys.exit("RuntimeError: CUDA out of memory")
speed = {{"flexgen": 10.0, "flexh2o": 25.0}}["flexh2o" if args[0] == "-m" else "flexgen"]
figures = {{f"{{k}}_throughput": speed * (2 if k == "decode" else 1) for k in ("prefill", "decode", "total")}}
figures.update({{f"{{k}}_latency_s": 1.0 for k in ("prefill", "decode", "total")}})
if args[0] == "-m":
    report = {{**figures, "peak_gpu_mem_bytes": 1 << 30, "projected_from_steps": None}}
    json.dump(report, open(value("--json-out"), "w"))
else:
    with open(value("--log-file"), "a") as log:
        for k in ("prefill", "decode", "total"):
            log.write(f"{{k}} latency: 1.000 s\\t{{k}} throughput: {{figures[k + '_throughput']:.3f}} token/s\\n")
"""


def fake_engines(tmp_path, failing_batch=0) -> str:
    path = tmp_path / "fake_python"
    path.write_text(FAKE_ENGINES.format(python=sys.executable, failing_batch=failing_batch))
    path.chmod(0o755)
    return str(path)


def test_runs_interleave_compare_and_write_every_row(tmp_path):
    seen = []
    rows = vs.run_settings(vs.SETTINGS, [], time.monotonic() + 120,
                           lambda rows: seen.append([dict(r) for r in rows]), fake_engines(tmp_path, failing_batch=24))
    six, thirty, h2o = rows
    assert six["flexgen"]["total_throughput"] == 10.0 and six["flexh2o"]["total_throughput"] == 25.0
    assert six["total_ratio"] == 2.5 and six["decode_ratio"] == 2.5 and six["target_met"]  # decode >= 2.5x
    assert thirty["flexgen"]["error"] == "exit 1: RuntimeError: CUDA out of memory" and "total_ratio" not in thirty
    assert h2o["flexgen"]["from"] == thirty["setting"] and "error" in h2o["flexgen"]
    # written after FlexGen's run and again once flexh2o's is in, setting by setting
    assert [len(s) for s in seen] == [1, 1, 2, 2, 3]
    assert "flexh2o" not in seen[0][0] and "flexh2o" in seen[1][0]
    text = "\n".join(vs.table(rows))
    assert "| 25.0 / 50.0 | **2.50x** | **2.50x** | decode >= 2.5x FlexGen's: met |" in text
    assert "**exit 1: RuntimeError: CUDA out of memory**" in text


def test_nothing_starts_after_the_deadline(tmp_path):
    rows = vs.run_settings(vs.SETTINGS[:1], [], time.monotonic() - 1, lambda rows: None, fake_engines(tmp_path))
    assert "flexgen" not in rows[0] and "flexh2o" not in rows[0]
    assert "| not run (time) | not run (time) |" in "\n".join(vs.table(rows))


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "vs"
    r = subprocess.run([sys.executable, "scripts/bench_vs_flexgen.py", "--out", str(out)], cwd=REPO,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("bench_vs_flexgen: no CUDA device")
    assert len(r.stdout.splitlines()) == 1
    assert not os.path.exists(str(out) + ".json")


@pytest.mark.parametrize("flags, named", [(["--only", "opt-175b"], "--only"), (["--budget", "0"], "--budget")])
def test_bad_flags_are_one_line_naming_the_flag(flags, named, capsys):
    assert vs.main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {named}") and "\n" not in err
