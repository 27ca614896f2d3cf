"""`make gpu-bench` on the CPU: the paper's T4 rows, their batch shapes, one row measured on a small
model, rows streamed from a worker within a budget, the sections' targets and tables, and the exit
without CUDA."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO
from test_bench_vs_flexgen import fake_engines

sys.path.insert(0, os.path.join(REPO, "scripts"))
import gpu_bench  # noqa: E402
import t4_measure  # noqa: E402
from check_sections import Check  # noqa: E402
from flexh2o import Engine, Policy  # noqa: E402


def test_the_papers_rows():
    rows = t4_measure.rows_of("opt-30b")
    assert [r["paper_batch"] for r in rows] == [144, 728, 80, 416, 48, 264]
    assert [r["gen_len"] for r in rows] == [32, 32, 512, 512, 1024, 1024]
    assert rows[0]["kv"]["kv_policy"] == "full" and rows[1]["kv"] == dict(kv_policy="h2o", hh_ratio=0.1,
                                                                          recent_ratio=0.1)
    assert [r["paper_batch"] for r in t4_measure.rows_of("opt-6.7b")] == [2, 4, 1, 4, 1, 4]


def test_batch_shape_splits_the_papers_batch_or_takes_the_largest_that_fits():
    assert t4_measure.batch_shape(144, lambda b, nb: True) == (144, 1, "")
    assert t4_measure.batch_shape(144, lambda b, nb: b <= 48) == (48, 3, "")
    # The host holds 100 sequences at most and a gpu-batch 40: no split of 144 fits; 4 x 25 is the most.
    b, nb, note = t4_measure.batch_shape(144, lambda b, nb: b <= 40 and b * nb <= 100)
    assert (b, nb) == (25, 4) and "does not fit" in note
    assert t4_measure.batch_shape(8, lambda b, nb: False)[:2] == (0, 1)


@pytest.fixture(scope="module")
def small_engine():
    with Engine.from_pretrained("opt-125m", policy=Policy(gpu_batch_size=1), device="cpu", dummy=True) as engine:
        yield engine


@pytest.fixture
def short_prompts(monkeypatch):
    """Rows measured on 32-token prompts instead of the paper's 512: what these tests check of a row
    (its batch shape, steps, figures and the pre-flight's cut) does not depend on the prompt's length."""
    monkeypatch.setattr(t4_measure, "PROMPT_LEN", 32)


def test_a_row_on_a_small_model_is_timed_as_flexgen_times_it(small_engine, short_prompts):
    row = {"name": "opt-125m 512+16, H2O-20%", "model": "opt-125m", "gen_len": 16, "kind": "H2O-20%",
           "kv": t4_measure.H2O, "paper_batch": 2, "paper_tok_s": 1.0}
    out = t4_measure.measure_row(small_engine, row, None, cut=4)
    assert "error" not in out, out.get("error")
    assert (out["gpu_batch_size"], out["num_gpu_batches"], out["steps_run"]) == (2, 1, 4)
    assert small_engine.last_stats.steps_done == 4 and small_engine.last_stats.gen_len == 16
    assert out["decode_throughput"] == pytest.approx(2 * 15 / out["decode_latency_s"])
    assert out["predicted"] is None and json.loads(json.dumps(out)) == out


def test_a_batch_the_preflight_refuses_is_cut_to_what_fits(small_engine, short_prompts):
    from flexh2o.engine.preflight import add, run_need
    engine, caps = small_engine, dict(small_engine.caps)
    need = [add(engine.weight_need, run_need(engine.cache_spec, Policy(gpu_batch_size=b), engine.tiers.dtype.itemsize,
                                             t4_measure.PROMPT_LEN, 8, engine.tiers.compute))["gpu"] for b in (1, 2)]
    try:
        engine.caps["gpu"] = (need[0] + need[1]) // 2  # the weights and one sequence, not two
        assert t4_measure.admitted(engine, Policy(gpu_batch_size=1), 8)
        assert not t4_measure.admitted(engine, Policy(gpu_batch_size=2), 8)
        row = {"name": "x", "model": "opt-125m", "gen_len": 8, "kind": "FlexGen baseline", "kv": t4_measure.FULL,
               "paper_batch": 6, "paper_tok_s": 1.0}
        out = t4_measure.measure_row(engine, row, None, cut=4)
        assert out["batch"] == 1 and "does not fit" in out["batch_note"] and "error" not in out
    finally:
        engine.caps.clear()
        engine.caps.update(caps)


def test_the_prediction_beside_the_measurement():
    predicted = SimpleNamespace(total_throughput=10.0, to_dict=lambda: {"total_throughput": 10.0, "breakdown": {}})
    assert t4_measure.judge({"total_throughput": 12.4}, predicted)["within_target"]
    row = t4_measure.judge({"total_throughput": 7.4}, predicted)
    assert not row["within_target"] and row["measured_over_predicted"] == pytest.approx(0.74)
    assert "within_target" not in t4_measure.judge({"error": "OutOfMemoryError"}, predicted)


def fake_worker(tmp_path, lines: list, then: str) -> str:
    path = tmp_path / "worker"
    path.write_text(f"#!{sys.executable}\nimport sys, time\n" + "".join(f"print({line!r}, flush=True)\n"
                                                                       for line in lines) + then + "\n")
    path.chmod(0o755)
    return str(path)


def test_rows_stream_as_they_come_and_a_worker_past_its_time_is_stopped(tmp_path):
    got = []
    # A worker that would sleep an hour: waiting for it would hit the test's own timeout.
    worker = fake_worker(tmp_path, ['{"a": 1}', "a note", '{"a": 2}'], "time.sleep(3600)")
    assert gpu_bench.stream_rows([worker], 3, got.append) == "stopped after 3 s"
    assert got == [{"a": 1}, {"a": 2}]
    assert gpu_bench.stream_rows([fake_worker(tmp_path, [], "sys.exit(3)")], 30, got.append) == "exit 3"


HEADER = {"device": "test", "torch": "x", "cuda": "y", "command": "make gpu-bench", "started": "now",
          "flexgen_from": "wheels", "machine": {}}


def t4_rows(model: str) -> list:
    rows = []
    for within, r in zip((True, False), t4_measure.rows_of(model)):
        rows.append(json.dumps({**r, "gpu_batch_size": r["paper_batch"], "num_gpu_batches": 1,
                                "batch": r["paper_batch"], "batch_note": "", "steps_run": 5, "total_throughput": 8.0,
                                "decode_throughput": 9.0, "predicted": {"total_throughput": 8.5 if within else 20.0,
                                                                        "decode_throughput": 9.5},
                                "measured_over_predicted": 8.0 / (8.5 if within else 20.0), "within_target": within}))
    return rows


def test_a_t4_section_keeps_its_rows_targets_and_what_it_skipped(tmp_path):
    check = Check([str(tmp_path / "bench")], 60, HEADER, gpu_bench.describe)
    worker = fake_worker(tmp_path, t4_rows("opt-30b"), "")
    check.run("t4 opt-30b", 30, lambda s: gpu_bench.t4_section(s, "opt-30b", python=worker))
    s = check.result["sections"]["t4 opt-30b"]
    assert s["status"] == "ok" and len(s["rows"]) == 2 and len(s["skipped_rows"]) == 4
    assert [t["ok"] for t in check.result["targets"]] == [True, False]
    text = open(tmp_path / "bench.md").read()
    assert "| opt-30b 512+32, FlexGen baseline | 8.1, 144 | 144 (144 x 1) | 5 of 32 | 8.00 / 9.00 | 8.50 / 9.50 | " \
           "0.94 | yes |" in text
    assert "| 0.40 | **no** |" in text
    broken = fake_worker(tmp_path, [], "sys.exit(1)")
    check.run("t4 opt-6.7b", 30, lambda s: gpu_bench.t4_section(s, "opt-6.7b", python=broken))
    assert check.result["sections"]["t4 opt-6.7b"]["status"] == "failed"


def test_the_vs_flexgen_section_writes_both_results_and_targets(tmp_path):
    check = Check([str(tmp_path / "bench")], 120, HEADER, gpu_bench.describe)
    out = str(tmp_path / "vs_flexgen")
    engines = fake_engines(tmp_path)
    check.run("vs-flexgen", 100, lambda s: gpu_bench.vs_flexgen_section(s, [], [out], HEADER, python=engines))
    assert check.result["sections"]["vs-flexgen"]["status"] == "ok"
    assert len(json.load(open(out + ".json"))["rows"]) == 3
    # flexh2o 2.5x FlexGen in every figure here: the 6.7B decode and 30B total targets hold, H2O's 3x does not
    assert [t["ok"] for t in check.result["targets"]] == [True, True, False]
    assert "## FlexGen 0.1.8 beside flexh2o" in open(tmp_path / "bench.md").read()


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    r = subprocess.run([sys.executable, "scripts/gpu_bench.py", "--out", str(tmp_path / "b")], cwd=REPO,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("gpu-bench: no CUDA device") and len(r.stdout.splitlines()) == 1
