"""Planning a pipeline: each stage placed within its own memory, the pipeline's throughput projected
from the stages' predicted times, the bubble and the link (planning/pipeline_plan.py)."""

import json

import pytest

import flexh2o.plan
from flexh2o.models import resolve_model
from flexh2o.host.hardware import from_dict, load_profile
from flexh2o.planning.pipeline_plan import PipelinePlan, StagePlan, plan_pipeline
from flexh2o.planning.search import caps_of, search
from flexh2o.engine.policy import Policy
from conftest import TEST_CPU_PROFILE

GB = 1 << 30


def test_one_stage_projects_what_the_single_process_search_predicts():
    spec, _ = resolve_model("opt-125m")
    profile = from_dict(TEST_CPU_PROFILE, "test")
    caps = caps_of(profile)
    single = search(spec, 128, 16, profile, caps, Policy(), total_batch=8)
    piped = plan_pipeline(spec, 128, 16, profile, caps, Policy(), 1, 1e9, total_batch=8)
    assert piped.micro_batches == 1 and piped.link_seconds == 0
    assert piped.throughput == pytest.approx(single.predicted.total_throughput, rel=0.1)


def test_stages_that_hold_their_slices_beat_one_process_that_must_offload():
    """OPT-1.3B in float16 on T4-like stages capped at 2 GB of GPU memory: one stage must stream
    most weights over PCIe, two hold theirs: the projection scales super-linearly."""
    spec, _ = resolve_model("opt-1.3b")
    t4 = load_profile("t4")
    caps = caps_of(t4, gpu_mem=2 * GB)
    one = plan_pipeline(spec, 256, 32, t4, caps, Policy(), 1, 2e9, total_batch=32)
    two = plan_pipeline(spec, 256, 32, t4, caps, Policy(), 2, 2e9, total_batch=32)
    assert two.stages[0].layers.start == 0 and two.stages[0].layers.stop == two.stages[1].layers.start
    assert two.stages[1].layers.stop == len(spec.build_layers())
    assert all(s.policy.w_gpu_percent > one.stages[0].policy.w_gpu_percent for s in two.stages)
    assert two.throughput > 2 * one.throughput


def test_fewer_micro_batches_than_stages_leave_the_busiest_stage_idle():
    plan = PipelinePlan([StagePlan(range(0, 1), Policy(), 1.0), StagePlan(range(1, 2), Policy(), 1.0),
                         StagePlan(range(2, 3), Policy(), 1.0)], 1, 4, 8, 0.5, 3.5)
    assert plan.bubble_share == pytest.approx(1 - 1 / 3.5)


def test_plan_prints_each_stage_and_the_projection(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert flexh2o.plan.main(["--model", "opt-1.3b", "--hardware", "t4", "--prompt-len", "256", "--gen-len", "32",
                              "--gpu-mem", "2GB", "--batch", "32", "--pipeline-stages", "2", "--link-bandwidth", "2",
                              "--json-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stage 0: layers 0-" in text and "stage 1: layers " in text and "predicted: total" in text
    saved = json.loads(out.read_text())
    assert saved["stages"] == 2 and saved["batch"] == 32 and len(saved["stage_plans"]) == 2


def test_a_pipeline_plan_without_a_link_figure_is_refused(tmp_path, capsys):
    path = tmp_path / "nolink.json"
    path.write_text(json.dumps({**{k: v for k, v in TEST_CPU_PROFILE.items() if k != "link_bandwidth"}, "name": "nolink"}))
    assert flexh2o.plan.main(["--model", "opt-125m", "--hardware", str(path), "--pipeline-stages", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --link-bandwidth: the nolink profile has no link_bandwidth")
    assert flexh2o.plan.main(["--model", "opt-125m", "--hardware", str(path), "--pipeline-stages", "40",
                              "--link-bandwidth", "1"]) == 2
    assert "--pipeline-stages: must be between 1 and the 12 decoder layers" in capsys.readouterr().err
