"""scripts/products_vs_llamacpp.py: llama.cpp's times read from test-backend-ops' own lines (only
the matrix asked for), and flexh2o's products timed on that shape."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import products_vs_llamacpp as script  # noqa: E402

LINES = """Backend 1/1: CPU
  MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=1,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,m_v=0,pad=0):                276 runs -  4157.83 us/run - 117.44 MFLOP/run -  28.25 GFLOPS
  MUL_MAT(type_a=f16,type_b=f32,m=4096,n=8,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,m_v=0,pad=0):                  90 runs - 12133.24 us/run - 939.52 MFLOP/run -  77.43 GFLOPS
  MUL_MAT(type_a=q8_0,type_b=f32,m=16,n=1,k=256,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,m_v=0,pad=0):                  90 runs - 1.5 us/run - 1 MFLOP/run -  1 GFLOPS
"""


def test_llama_cpp_times_come_from_its_lines_for_the_matrix_asked_for(monkeypatch):
    asked = []

    def run(argv, **kwargs):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=LINES, stderr="")
    monkeypatch.setattr(script.subprocess, "run", run)
    times = script.llama_times("test-backend-ops", ["Q4_0", "F16", "Q8_0"], [1, 8])
    assert times == {("Q4_0", 1): 4157.83, ("F16", 8): 12133.24}  # (the 16 x 256 Q8_0 case is another matrix)
    assert asked[0][:5] == ["test-backend-ops", "perf", "-b", "CPU", "-o"]


@pytest.mark.skipif(script.native.library() is None, reason="no C compiler: the kernels cannot be built here")
def test_flexh2o_times_each_kind_at_each_row_count(monkeypatch):
    monkeypatch.setattr(script, "N", 64)
    monkeypatch.setattr(script, "K", 256)
    times = script.flexh2o_times("Q4_1", [1, 2], threads=1, repeats=2)
    assert set(times) == {("float32", 1), ("int8", 1), ("float32", 2), ("int8", 2)}
    assert all(us > 0 for us in times.values())
    assert set(script.flexh2o_times("F16", [1], threads=1, repeats=1)) == {("float32", 1)}
