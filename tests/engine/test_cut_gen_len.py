"""FlexGen's benchmark protocol in `python -m flexh2o.run`: --warmup and --cut-gen-len (a run cut
short on purpose, its decode projected to --gen-len as FlexGen projects it)."""

import json

import pytest

from flexh2o.engine.engine import Engine
from flexh2o.runs.report import projected_decode_seconds
from flexh2o.run import main


def test_projection_keeps_two_decode_steps_and_averages_the_rest():
    # prompt step 9 s (not decode); decode steps 1, 2 as they ran, then the mean of 3 and 5 for 7 more
    assert projected_decode_seconds([9, 1, 2, 3, 5], 10) == 1 + 2 + 4 * 7
    assert projected_decode_seconds([9, 1, 2, 3], 4) == 6  # every step ran: nothing projected
    with pytest.raises(ValueError):
        projected_decode_seconds([9, 1, 2], 10)


def test_a_cut_run_reports_gen_len_from_the_steps_it_ran(tmp_path, capsys, monkeypatch):
    calls, generate = [], Engine.generate

    def counted(engine, input_ids, *args, **kwargs):
        calls.append((list(input_ids.shape), kwargs["max_new_tokens"]))
        return generate(engine, input_ids, *args, **kwargs)
    monkeypatch.setattr(Engine, "generate", counted)
    out = tmp_path / "report.json"
    code = main(["--model", "opt-125m", "--dummy", "--prompt-len", "40", "--gen-len", "40", "--cut-gen-len", "5",
                 "--warmup", "--gpu-batch-size", "2", "--json-out", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert calls == [([2, 32], 1), ([2, 40], 40)]  # the warm-up, then the run
    assert r["steps_done"] == 5 and r["gen_len"] == 40 and r["projected_from_steps"] == 5
    assert r["decode_throughput"] == pytest.approx(2 * 39 / r["decode_latency_s"])
    assert r["total_throughput"] == pytest.approx(2 * 40 / (r["prefill_latency_s"] + r["decode_latency_s"]))
    # The cache was sized for all 40 tokens: the full cache's slots are the whole job's.
    assert r["kv_policy"] == "full (80 slots per sequence)"
    assert "ran 5 token steps; decode projected to gen_len" in capsys.readouterr().out


def test_an_uncut_run_says_nothing_was_projected(tmp_path):
    out = tmp_path / "report.json"
    assert main(["--model", "opt-125m", "--dummy", "--prompt-len", "8", "--gen-len", "4", "--gpu-batch-size", "1",
                 "--no-stop-at-eos", "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["projected_from_steps"] is None and r["steps_done"] == 4


@pytest.mark.parametrize("flags, named", [
    (["--cut-gen-len", "3"], "--cut-gen-len"),
    (["--cut-gen-len", "9"], "--cut-gen-len"),
    (["--cut-gen-len", "4", "--input", "x.jsonl", "--output", "y.jsonl"], "--cut-gen-len"),
    (["--warmup", "--input", "x.jsonl", "--output", "y.jsonl"], "--warmup"),
])
def test_bad_benchmark_flags_are_one_line_naming_the_flag(flags, named, capsys):
    code = main(["--model", "opt-125m", "--dummy", "--prompt-len", "8", "--gen-len", "8", "--gpu-batch-size", "1",
                 *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {named}") and "\n" not in err
