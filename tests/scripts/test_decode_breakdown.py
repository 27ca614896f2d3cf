"""scripts/decode_breakdown.py: a part's time counted once (by its outermost timer) and only in
decode steps; the parts of a real run's step add up to no more than the step."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, SMOL_GGUF

sys.path.insert(0, os.path.join(REPO, "scripts"))
from decode_breakdown import Timers  # noqa: E402


def test_a_call_inside_another_timed_call_counts_as_the_outer_part():
    timers = Timers()
    inner = timers.wrap("block product", lambda: None)
    outer = timers.wrap("LM head", lambda: inner())
    timers.decoding = True
    outer()
    inner()
    assert timers.seconds["LM head"] > 0 and timers.seconds["block product"] > 0
    before = dict(timers.seconds)
    for _ in range(1000):
        outer()
    assert timers.seconds["block product"] == before["block product"]


def test_the_prompt_step_is_not_counted():
    timers = Timers()
    timers.wrap("attention", lambda: None)()
    assert timers.seconds["attention"] == 0


@pytest.mark.slow  # (a real model four times: make test-all)
@pytest.mark.skipif(not os.path.isfile(SMOL_GGUF), reason="make setup downloads the SmolLM2 file")
@pytest.mark.parametrize("flags,batches,timed", [([], ["1", "4"], "layers in C"),
                                                 (["--one-by-one"], ["1"], "block product")])
def test_a_real_runs_parts_add_up_to_its_step(tmp_path, flags, batches, timed):
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "decode_breakdown.py"), "--batches", *batches,
                           "--prompt-len", "16", "--gen-len", "6", "--no-llama", "--rounds", "1", "--out", str(tmp_path / "b"),
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    r = json.load(open(tmp_path / "b.json"))
    for row in r["rows"]:
        parts = row["parts_s"]
        assert parts[timed] > 0 and parts["LM head"] > 0
        if flags:  # layer by layer: every part timed apart, nothing in one call
            assert parts["attention"] > 0 and parts["layers in C"] == 0
        else:  # the layers' products and attention inside their one call
            assert parts["block product"] == 0 and parts["attention"] == 0
        assert min(parts.values()) >= 0 and abs(sum(parts.values()) - row["step_s"]) < 1e-9
        assert row["floor_s"] == row["weight_bytes"] / r["read_bandwidth_bytes_s"]
    assert f"| {batches[-1]} |" in open(tmp_path / "b.md").read()
